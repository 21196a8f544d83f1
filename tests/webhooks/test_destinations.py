"""The SSRF guard on its own: which addresses pass, how the allow-list matches, where the sender connects."""

from __future__ import annotations

import ipaddress
import re

import pytest

from portal.webhooks.destinations import DestinationRefused, DestinationUnresolved, destination_check


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.2/",
        "http://[::1]/",
        "http://[fe80::1]/",
        "http://169.254.169.254/",
        "http://192.168.1.10/",
        "http://172.16.0.1/",
        "http://0.0.0.0/",
        "http://224.0.0.1/",
        "http://240.0.0.1/",
        "http://[::ffff:10.0.0.1]/",
    ],
)
def test_every_non_public_address_is_refused_without_an_allow_list(url: str) -> None:
    with pytest.raises(DestinationRefused, match="address; webhooks go to public addresses"):
        destination_check(url, allowed_hosts=[])


CARRIED = {"127.0.0.1": "loopback", "10.1.2.3": "private", "169.254.169.254": "link-local"}
PUBLIC_V4 = "93.184.215.14"
TEREDO_SERVER = "65.54.227.120"  # a public Teredo server's address


def _hex32(v4: str, *, invert: bool = False) -> str:
    value = int(ipaddress.IPv4Address(v4)) ^ (0xFFFFFFFF if invert else 0)
    return f"{value >> 16:x}:{value & 0xFFFF:x}"


EMBEDDING_FORMS = {
    "ipv4-mapped": lambda v4: f"::ffff:{v4}",
    "ipv4-compatible": lambda v4: f"::{v4}",
    "ipv4-translated": lambda v4: f"::ffff:0:{v4}",
    "nat64": lambda v4: f"64:ff9b::{v4}",
    "6to4": lambda v4: f"2002:{_hex32(v4)}::1",
    "teredo": lambda v4: f"2001:0:{_hex32(TEREDO_SERVER)}:8000:63bf:{_hex32(v4, invert=True)}",
}


@pytest.mark.parametrize("carried", list(CARRIED))
@pytest.mark.parametrize("form", list(EMBEDDING_FORMS))
def test_an_ipv6_address_carrying_a_non_public_ipv4_address_is_refused(form: str, carried: str) -> None:
    address = EMBEDDING_FORMS[form](carried)
    with pytest.raises(DestinationRefused, match=re.escape(f"{carried}, a {CARRIED[carried]} address")):
        destination_check(f"http://[{address}]/hook", allowed_hosts=[])


@pytest.mark.parametrize("form", list(EMBEDDING_FORMS))
def test_an_ipv6_address_carrying_a_public_ipv4_address_is_judged_by_it(form: str) -> None:
    address = EMBEDDING_FORMS[form](PUBLIC_V4)
    checked = ipaddress.ip_address(destination_check(f"http://[{address}]/hook", allowed_hosts=[]).address)
    assert checked in (ipaddress.ip_address(address), ipaddress.ip_address(PUBLIC_V4))


@pytest.mark.parametrize("carried", [*CARRIED, PUBLIC_V4])
def test_a_local_use_nat64_address_is_refused_whatever_it_carries(carried: str) -> None:
    with pytest.raises(DestinationRefused, match="local-use NAT64"):
        destination_check(f"http://[64:ff9b:1::{carried}]/hook", allowed_hosts=[])


def test_a_teredo_address_whose_server_is_not_public_is_refused() -> None:
    address = f"2001:0:{_hex32('10.0.0.1')}:8000:63bf:{_hex32(PUBLIC_V4, invert=True)}"
    with pytest.raises(DestinationRefused, match=r"carrying 10\.0\.0\.1, a private address"):
        destination_check(f"http://[{address}]/hook", allowed_hosts=[])


def test_the_allow_list_matches_the_host_as_written_and_the_port_when_given() -> None:
    assert destination_check("http://127.0.0.1:9000/x", allowed_hosts=["127.0.0.1:9000"]).address == "127.0.0.1"
    assert destination_check("http://127.0.0.1:9000/x", allowed_hosts=["127.0.0.1"]).address == "127.0.0.1"
    assert destination_check("http://[::1]:9000/x", allowed_hosts=["[::1]:9000"]).address == "::1"
    for url, allowed in [
        ("http://127.0.0.1:9001/x", ["127.0.0.1:9000"]),
        ("http://localhost:9000/x", ["127.0.0.1"]),
    ]:
        with pytest.raises(DestinationRefused):
            destination_check(url, allowed_hosts=allowed)


def test_the_checked_address_replaces_the_host_and_the_host_travels_in_the_header() -> None:
    destination = destination_check("https://93.184.215.14/hook?x=1", allowed_hosts=[])
    assert destination.url == "https://93.184.215.14:443/hook?x=1"
    assert (destination.host_header, destination.server_name) == ("93.184.215.14", "93.184.215.14")
    pinned = destination_check("http://localhost:8080", allowed_hosts=["localhost"])
    assert pinned.url in ("http://127.0.0.1:8080/", "http://[::1]:8080/")
    assert pinned.host_header == "localhost:8080" and pinned.server_name == "localhost"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("file:///etc/passwd", "http:// or https://"),
        ("http:///path", "no host"),
        ("http://u:p@93.184.215.14/", "user name or password"),
        ("http://93.184.215.14:99999/", "not a valid URL"),
    ],
)
def test_urls_of_the_wrong_shape_are_refused(url: str, reason: str) -> None:
    with pytest.raises(DestinationRefused, match=reason):
        destination_check(url, allowed_hosts=[])


def test_a_name_that_does_not_resolve_is_unresolved_not_refused() -> None:
    with pytest.raises(DestinationUnresolved):
        destination_check("https://no-such-host.invalid/hook", allowed_hosts=[])
