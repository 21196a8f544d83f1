"""Where a webhook may go: the guard against server-side request forgery, at registration and at delivery.

A URL's host is resolved and every address it resolves to must be public (not loopback, link-local,
private, reserved, multicast or unspecified) unless the operator lists the host, or host:port, in
`BATCHERY_WEBHOOK_ALLOWED_HOSTS`. The sender then connects to the address checked here, not to the
name, so a DNS answer that changes between the check and the connection (rebinding) cannot move it.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Collection
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
DEFAULT_PORTS = {"http": 80, "https": 443}


class DestinationRefused(Exception):
    """The URL may never be delivered to as things stand: a refusal, not a hiccup."""


class DestinationUnresolved(Exception):
    """The host does not resolve now; at delivery that is transient and worth another attempt."""


@dataclass(frozen=True)
class Destination:
    """A checked URL, pinned to one of the addresses that were checked."""

    url: str
    """The URL with the checked address in place of the host name: what is connected to."""
    host_header: str
    """The `Host` header the receiver expects (the URL's own host and port)."""
    server_name: str
    """The name TLS sends (SNI) and checks the certificate against."""
    address: str


def url_shape_problem(url: str) -> str | None:
    """Why a URL cannot be a webhook endpoint by its shape alone, or None."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a port out of range)
    except ValueError as exc:
        return f"not a valid URL: {exc}"
    if parts.scheme not in DEFAULT_PORTS:
        return "the URL must start with http:// or https://"
    if not parts.hostname:
        return "the URL has no host"
    if parts.username is not None or parts.password is not None:
        # They would travel in every request and show in every log and page; put them in the path.
        return "the URL may not carry a user name or password"
    return None


def _unmapped(address: IpAddress) -> IpAddress:
    """::ffff:127.0.0.1 is 127.0.0.1, and is judged as such."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _is_public(address: IpAddress) -> bool:
    # `is_global` is False for loopback, link-local, private, reserved, shared (100.64/10) and
    # unspecified addresses; some multicast ranges count as global, hence the second test.
    return address.is_global and not address.is_multicast


def _kind(address: IpAddress) -> str:
    for kind in ("loopback", "link_local", "private", "multicast", "unspecified", "reserved"):
        if getattr(address, f"is_{kind}"):
            return kind.replace("_", "-")
    return "non-public"


def _is_listed(host: str, port: int, allowed_hosts: Collection[str]) -> bool:
    literal = f"[{host}]" if ":" in host else host  # an IPv6 host is written in brackets with a port
    names = {host, literal, f"{literal}:{port}"}
    return any(entry.strip().lower() in names for entry in allowed_hosts)


def destination_check(url: str, *, allowed_hosts: Collection[str]) -> Destination:
    """Resolve the URL's host and check every address; raises `DestinationRefused` or
    `DestinationUnresolved`. The host is compared with the allow-list as written in the URL: listing
    127.0.0.1 does not let `localhost` through."""
    problem = url_shape_problem(url)
    if problem is not None:
        raise DestinationRefused(problem)
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or DEFAULT_PORTS[parts.scheme]
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise DestinationUnresolved(f"{host} does not resolve: {exc}") from None
    # A link-local IPv6 answer may carry a zone ("fe80::1%eth0"); the address is what is judged.
    addresses = list(dict.fromkeys(_unmapped(ipaddress.ip_address(str(info[4][0]).split("%")[0])) for info in found))
    if not addresses:
        raise DestinationUnresolved(f"{host} resolves to no address")
    if not _is_listed(host, port, allowed_hosts):
        for address in addresses:
            if not _is_public(address):
                raise DestinationRefused(
                    f"{host} resolves to {address}, a {_kind(address)} address; webhooks go to public addresses "
                    "unless the operator allows the host in BATCHERY_WEBHOOK_ALLOWED_HOSTS"
                )
    address = addresses[0]
    literal = f"[{address}]" if address.version == 6 else str(address)
    return Destination(
        url=urlunsplit((parts.scheme, f"{literal}:{port}", parts.path or "/", parts.query, "")),
        host_header=parts.netloc,
        server_name=host,
        address=str(address),
    )
