"""Where a webhook may go: the guard against server-side request forgery, at registration and at delivery.

A URL's host is resolved and every address it resolves to must be public (not loopback, link-local,
private, reserved, multicast or unspecified) unless the operator lists the host, or host:port, in
`BATCHERY_WEBHOOK_ALLOWED_HOSTS`. An IPv6 address that carries an IPv4 address (IPv4-mapped and
-compatible, NAT64, 6to4, Teredo) is judged by the IPv4 address it carries, since a gateway on the way
may deliver it there; a local-use NAT64 address (64:ff9b:1::/48) is refused. The sender then
connects to the address checked here, not to the name, so a DNS answer that changes between the
check and the connection (rebinding) cannot move it.

The look-up itself is bounded (`resolve_timeout_s`): `getaddrinfo` has no timeout of its own, and a
receiver's slow name server would otherwise hold a portal worker at registration, or a sender past its
attempt's deadline, for as long as the system resolver's retries take.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
DEFAULT_PORTS = {"http": 80, "https": 443}
RESOLVE_TIMEOUT_S = 5.0
"""The look-up's bound where the caller names none."""
LOOKUPS_AT_ONCE = 16
"""Look-ups a process runs at once: one past its bound goes on in its thread until the resolver gives up,
so a flood of slow names holds at most this many threads; past them a look-up is answered unresolved."""

_lookups = threading.BoundedSemaphore(LOOKUPS_AT_ONCE)


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


def url_redacted(url: str) -> str:
    """`scheme://host[:port]/…`: a webhook URL as logs and stored messages show it, since its path or
    query may carry the receiver's token."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return "(an invalid URL)"
    if not host:
        return "(a URL without a host)"
    literal = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{literal}{f':{port}' if port else ''}/…"


def text_redacted(text: str, *urls: str) -> str:
    """`text` with each of `urls` (as written) in its redacted form: for error messages that quote one."""
    for url in sorted(set(urls), key=len, reverse=True):
        if url:
            text = text.replace(url, url_redacted(url))
    return text


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


# IPv6 ranges that carry an IPv4 address in their last 32 bits. Written out rather than taken from
# `ipaddress`, whose `is_private`/`is_global` for these ranges differ between Python versions.
_CARRY_LAST_32 = (
    ipaddress.IPv6Network("::ffff:0:0/96"),  # IPv4-mapped (also `ipv4_mapped`)
    ipaddress.IPv6Network("::ffff:0:0:0/96"),  # IPv4-translated (SIIT, RFC 2765)
    ipaddress.IPv6Network("::/96"),  # IPv4-compatible (deprecated; :: and ::1 fall here too)
    ipaddress.IPv6Network("64:ff9b::/96"),  # NAT64's well-known prefix (RFC 6052)
)
_SIX_TO_FOUR = ipaddress.IPv6Network("2002::/16")  # the IPv4 address in bits 16 to 47 (RFC 3056)
_TEREDO = ipaddress.IPv6Network("2001::/32")  # server and (obfuscated) client addresses (RFC 4380)
# Local-use NAT64 (RFC 8215): where the IPv4 address sits depends on the site's prefix length.
_LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")


def _carried(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address] | None:
    """The IPv4 addresses an IPv6 address carries (Teredo: its server and its client), or None."""
    value = int(address)
    if any(address in network for network in _CARRY_LAST_32):
        return [ipaddress.IPv4Address(value & 0xFFFFFFFF)]
    if address in _SIX_TO_FOUR:
        return [ipaddress.IPv4Address((value >> 80) & 0xFFFFFFFF)]
    if address in _TEREDO:
        # The client's address is stored inverted, so that NATs do not rewrite it.
        return [ipaddress.IPv4Address((value >> 64) & 0xFFFFFFFF), ipaddress.IPv4Address(~value & 0xFFFFFFFF)]
    return None


def _unmapped(address: IpAddress) -> IpAddress:
    """::ffff:127.0.0.1 is 127.0.0.1, and is judged as such."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _refusal(address: IpAddress) -> str | None:
    """Why webhooks may not go to `address` (its kind), or None for a public address."""
    if isinstance(address, ipaddress.IPv6Address):
        if address in _LOCAL_NAT64:
            return "a local-use NAT64 address"
        carried = _carried(address)
        if carried is not None:
            for inner in carried:
                if not _is_public(inner):
                    return f"an address carrying {inner}, a {_kind(inner)}"
            return None
    return None if _is_public(address) else f"a {_kind(address)}"


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


def _resolve(host: str, port: int, *, timeout_s: float) -> list[Any]:
    """`getaddrinfo` of the host within `timeout_s`, in a daemon thread of its own (left to finish by itself
    past the bound); raises `DestinationUnresolved` when it fails, or does not answer in time."""
    started = time.monotonic()
    if not _lookups.acquire(timeout=timeout_s):
        raise DestinationUnresolved(f"{host} was not looked up: {LOOKUPS_AT_ONCE} look-ups are in progress here")
    answer: dict[str, Any] = {}
    done = threading.Event()

    def look_up() -> None:
        try:
            answer["found"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            answer["error"] = exc
        finally:
            _lookups.release()
            done.set()

    threading.Thread(target=look_up, name=f"resolve {host}", daemon=True).start()
    if not done.wait(max(0.0, timeout_s - (time.monotonic() - started))):
        raise DestinationUnresolved(f"{host} did not resolve within {timeout_s:g} s")
    if "error" in answer:
        raise DestinationUnresolved(f"{host} does not resolve: {answer['error']}")
    return list(answer["found"])


def destination_check(
    url: str, *, allowed_hosts: Collection[str], resolve_timeout_s: float = RESOLVE_TIMEOUT_S
) -> Destination:
    """Resolve the URL's host (within `resolve_timeout_s`) and check every address; raises
    `DestinationRefused` or `DestinationUnresolved`. The host is compared with the allow-list as written
    in the URL: listing 127.0.0.1 does not let `localhost` through."""
    problem = url_shape_problem(url)
    if problem is not None:
        raise DestinationRefused(problem)
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or DEFAULT_PORTS[parts.scheme]
    found = _resolve(host, port, timeout_s=resolve_timeout_s)
    # A link-local IPv6 answer may carry a zone ("fe80::1%eth0"); the address is what is judged.
    addresses = list(dict.fromkeys(_unmapped(ipaddress.ip_address(str(info[4][0]).split("%")[0])) for info in found))
    if not addresses:
        raise DestinationUnresolved(f"{host} resolves to no address")
    if not _is_listed(host, port, allowed_hosts):
        for address in addresses:
            refusal = _refusal(address)
            if refusal is not None:
                raise DestinationRefused(
                    f"{host} resolves to {address}, {refusal} address; webhooks go to public addresses "
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
