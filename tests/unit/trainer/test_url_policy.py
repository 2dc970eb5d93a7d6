"""trainer.grading.url_policy: which URLs a tenant may make the service call (no SSRF into the deployment's network),
and the pinned request that connects to the address that was checked."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from trainer.grading.url_policy import Resolver, UrlPolicy, embedded_ipv4
from trainer.spec.urls import UrlRefused, parse_url

DEFAULT = UrlPolicy()


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "a loopback address"),
        ("127.8.9.10", "a loopback address"),
        ("::1", "a loopback address"),
        ("10.1.2.3", "a private address"),
        ("172.16.0.1", "a private address"),
        ("192.168.1.1", "a private address"),
        ("fd12:3456::1", "a private address"),
        ("169.254.169.254", "a link-local address"),  # the cloud metadata service
        ("fe80::1", "a link-local address"),
        ("0.0.0.0", "an unspecified address"),
        ("::", "an unspecified address"),
        ("100.64.0.1", "not a globally routable address"),  # carrier-grade NAT
        ("224.0.1.1", "a multicast address"),  # globally scoped multicast: still no
        ("ff0e::1", "a multicast address"),
        ("240.0.0.1", "a private address"),  # reserved
        ("192.0.2.10", "a private address"),  # documentation
    ],
)
def test_internal_and_special_addresses_are_refused_by_default(address: str, why: str) -> None:
    assert DEFAULT.address_problem(address) == f"{address} is {why}, which this deployment does not allow"


@pytest.mark.parametrize(
    ("address", "inner"),
    [
        ("::ffff:127.0.0.1", "127.0.0.1"),  # IPv4-mapped
        ("::ffff:169.254.169.254", "169.254.169.254"),
        ("64:ff9b::a00:1", "10.0.0.1"),  # NAT64: Python calls 64:ff9b::/96 global
        ("2002:a00:1::1", "10.0.0.1"),  # 6to4
        ("2001:0:4136:e378:8000:63bf:f5ff:fffe", "10.0.0.1"),  # Teredo: the client's address, bits inverted
    ],
)
def test_an_ipv6_address_carrying_an_internal_ipv4_one_is_refused(address: str, inner: str) -> None:
    import ipaddress

    assert str(embedded_ipv4(ipaddress.ip_address(address))) == inner
    problem = DEFAULT.address_problem(address)
    assert problem is not None and problem.startswith(f"{ipaddress.ip_address(address)} ({inner}) is a ")


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_are_allowed(address: str) -> None:
    assert DEFAULT.address_problem(address) is None


def test_allow_networks_open_an_internal_network_and_deny_networks_win() -> None:
    policy = UrlPolicy(allow_networks=("127.0.0.0/8", "10.1.0.0/16"), deny_networks=("10.1.2.0/24", "8.8.8.8/32"))
    assert policy.address_problem("127.0.0.1") is None
    assert policy.address_problem("::ffff:127.0.0.1") is None  # the mapped form of an allowed address
    assert policy.address_problem("10.1.9.9") is None
    assert policy.address_problem("10.2.0.1") == "10.2.0.1 is a private address, which this deployment does not allow"
    assert policy.address_problem("10.1.2.3") == "10.1.2.3 is in a network this deployment denies"
    assert policy.address_problem("8.8.8.8") == "8.8.8.8 is in a network this deployment denies"
    assert policy.address_problem("::1") is not None  # 127.0.0.0/8 does not open IPv6's loopback


def test_a_bad_network_or_scheme_in_the_policy_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"allow_networks: '10.0.0.0/33' is not an IP network"):
        UrlPolicy(allow_networks=("10.0.0.0/33",))
    with pytest.raises(ValueError, match="schemes"):
        UrlPolicy(schemes=("ftp",))


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://grader.example.com/", "the URL must start with https://"),
        ("ftp://grader.example.com/", "the URL must start with https://"),
        ("https:///path", "the URL has no host"),
        ("/grade", "the URL must start with https://"),
        ("https://user:secret@grader.example.com/", "the URL may not hold a user name or password"),
        ("https://grader.example.com/#x", "the URL may not have a #fragment"),
        ("https://127.0.0.1/grade", "127.0.0.1 is a loopback address"),
        ("https://[::1]:8443/grade", "::1 is a loopback address"),
        ("https://169.254.169.254/latest/meta-data", "169.254.169.254 is a link-local address"),
        ("https://" + "a" * 2100 + ".com/", "longer than 2048 characters"),
    ],
)
def test_check_url_refuses_forms_and_literal_addresses_the_policy_does_not_allow(url: str, problem: str) -> None:
    with pytest.raises(UrlRefused) as info:
        DEFAULT.check_url(url)
    assert problem in str(info.value)


def test_parse_url_checks_the_form_only() -> None:
    assert parse_url("http://127.0.0.1:9/x").host == "127.0.0.1"  # allowed schemes by default: http and https
    with pytest.raises(UrlRefused, match="may not hold a user name"):
        parse_url("https://a@b.example/")


def resolving_to(*answers: Sequence[str]) -> tuple[list[str], Resolver]:
    """A resolver giving each answer in turn, and the list of hosts it was asked for."""
    asked: list[str] = []
    pending = list(answers)

    async def resolve(host: str, port: int) -> Sequence[str]:
        asked.append(f"{host}:{port}")
        return pending.pop(0)

    return asked, resolve


def test_resolve_pins_the_request_to_the_checked_address() -> None:
    asked, resolver = resolving_to(["93.184.216.34", "2606:2800:220:1::1"])
    pinned = DEFAULT.resolve_sync("https://grader.example.com:8443/v1/grade?x=1", resolver)
    assert asked == ["grader.example.com:8443"]
    assert pinned.address == "93.184.216.34"
    assert str(pinned.request_url) == "https://93.184.216.34:8443/v1/grade?x=1"
    assert pinned.headers == {"Host": "grader.example.com:8443"}
    assert pinned.extensions == {"sni_hostname": "grader.example.com"}  # TLS checks the name's certificate


def test_an_ipv6_address_is_bracketed_and_http_has_no_tls_name() -> None:
    _, resolver = resolving_to(["2606:2800:220:1::1"])
    pinned = UrlPolicy(schemes=("http",)).resolve_sync("http://grader.example.com/g", resolver)
    assert str(pinned.request_url) == "http://[2606:2800:220:1::1]/g"
    assert pinned.headers == {"Host": "grader.example.com"} and pinned.extensions == {}


def test_a_name_with_any_internal_address_is_refused() -> None:
    # One public and one private address (or a rebinding resolver's mixed answer): either could be connected to.
    _, resolver = resolving_to(["93.184.216.34", "10.0.0.7"])
    with pytest.raises(UrlRefused) as info:
        DEFAULT.resolve_sync("https://grader.example.com/", resolver)
    assert str(info.value) == (
        "the host 'grader.example.com' resolves to 10.0.0.7 is a private address, which this deployment does not allow"
    )


def test_a_name_that_does_not_resolve_is_refused() -> None:
    async def fails(host: str, port: int) -> Sequence[str]:
        raise OSError(-2, "Name or service not known")

    with pytest.raises(UrlRefused, match=r"the host 'nowhere.invalid' does not resolve"):
        DEFAULT.resolve_sync("https://nowhere.invalid/", fails)
    _, empty = resolving_to([])
    with pytest.raises(UrlRefused, match="does not resolve"):
        DEFAULT.resolve_sync("https://nowhere.invalid/", empty)


def test_localhost_resolves_through_the_system_to_loopback_and_is_refused() -> None:
    with pytest.raises(UrlRefused, match=r"'localhost' resolves to (127\.0\.0\.1|::1) is a loopback address"):
        DEFAULT.resolve_sync("https://localhost/grade")


def test_an_ip_literal_is_not_resolved() -> None:
    asked, resolver = resolving_to(["10.0.0.1"])
    policy = UrlPolicy(schemes=("http",), allow_networks=("127.0.0.0/8",))
    pinned = policy.resolve_sync("http://127.0.0.1:8080/g", resolver)
    assert asked == [] and pinned.address == "127.0.0.1"
