"""Which URLs a tenant may make this service call: the deployment's allow/deny policy against SSRF (server-side request
forgery), for `endpoint` graders and, later, agentic RL's tool servers.

A tenant names a URL; a worker calls it from inside the deployment's network. Without a policy that URL could be the
cloud's metadata service (169.254.169.254), the database, Redis, the artifact store or an admin port on the worker's
own loopback. So every URL is checked twice over:

1. Its form (`check_url`): an absolute `http(s)` URL whose scheme the deployment allows (`https` only by default),
   with a host, no user name or password (credentials go in headers) and no fragment.
2. Its addresses, after DNS resolution (`resolve`): every address the host resolves to must be allowed. By default an
   address is allowed only when it is globally routable (`ipaddress`'s `is_global`) and not multicast: no loopback,
   private (10/8, 172.16/12, 192.168/16, fc00::/7), link-local (169.254/16, fe80::/10), shared (100.64/10), reserved,
   documentation or unspecified address. An IPv6 address that embeds an IPv4 one (IPv4-mapped `::ffff:a.b.c.d`, NAT64
   `64:ff9b::/96`, 6to4 `2002::/16`, Teredo) is judged by the IPv4 address too. The deployment may allow more
   (`allow_networks`, e.g. `127.0.0.0/8` in tests, or the subnet of an in-house grading service) and deny more
   (`deny_networks`, which always wins).

No DNS rebinding: a name may resolve to a public address when checked and to 127.0.0.1 a moment later, when the HTTP
client resolves it again. `Pinned` therefore makes the request to the checked address itself: the URL's host is
replaced by that IP address, the `Host` header keeps the name, and for HTTPS the TLS server name (SNI) and the
certificate check use the name (httpcore's `sni_hostname` request extension). Redirects must not be followed (a 3xx
could point anywhere) and proxies from the environment must not be used: the caller's client sets
`follow_redirects=False` and `trust_env=False` (`CLIENT_OPTIONS`).

This module is pure apart from DNS (`resolve` takes the resolver as an argument, so tests can make a name resolve to
anything).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from trainer.spec.urls import SCHEMES, UrlRefused, parse_url

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""(host, port) → the IP addresses the host resolves to, as strings."""

CLIENT_OPTIONS: dict[str, Any] = {"follow_redirects": False, "trust_env": False}
"""The options of an httpx client that calls pinned URLs: no redirects, no proxies from the environment."""

DNS_TIMEOUT_S = 5.0
"""How long `resolve_sync` waits for a host's addresses by default: a slow DNS server must not hold the caller."""

# `resolve_sync`'s lookups: not on its event loop's default executor, which `asyncio.run` waits for before it
# returns, so a getaddrinfo stuck past the deadline (it cannot be interrupted) would hold the caller regardless.
_DNS_THREADS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="url-policy-dns")

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def _networks(values: Iterable[str], what: str) -> tuple[IPNetwork, ...]:
    out = []
    for value in values:
        try:
            out.append(ipaddress.ip_network(value, strict=False))
        except ValueError:
            raise ValueError(f"{what}: {value!r} is not an IP network (expected e.g. 10.1.0.0/16 or ::1/128)") from None
    return tuple(out)


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (IPv4-mapped, NAT64 well-known prefix, 6to4, Teredo's client), or
    None."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    return None


@dataclass(frozen=True)
class UrlPolicy:
    """The deployment's policy: the schemes a URL may use, and the networks allowed beyond the default (globally
    routable unicast addresses only) and denied whatever else says (`deny_networks` wins over `allow_networks`).

    All fields are plain strings so that the policy travels as JSON (the worker hands it to the trainer process)."""

    schemes: tuple[str, ...] = ("https",)
    allow_networks: tuple[str, ...] = ()
    deny_networks: tuple[str, ...] = ()
    _allow: tuple[IPNetwork, ...] = field(init=False, repr=False, compare=False)
    _deny: tuple[IPNetwork, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        unknown = [s for s in self.schemes if s not in SCHEMES]
        if unknown or not self.schemes:
            raise ValueError(f"schemes: {unknown or 'none'} given; choose among {', '.join(SCHEMES)}")
        object.__setattr__(self, "_allow", _networks(self.allow_networks, "allow_networks"))
        object.__setattr__(self, "_deny", _networks(self.deny_networks, "deny_networks"))

    def address_problem(self, address: str | IPAddress) -> str | None:
        """None when the policy allows connecting to `address`, else why not (`10.0.0.5 is a private address, ...`;
        an IPv6 address carrying an IPv4 one is named with it: `::ffff:7f00:1 (127.0.0.1) is a loopback address`)."""
        ip = ipaddress.ip_address(address) if isinstance(address, str) else address
        inner = embedded_ipv4(ip)
        forms: list[IPAddress] = [ip] if inner is None else [inner, ip]
        label = str(ip) if inner is None else f"{ip} ({inner})"
        for form in forms:
            if any(form in net for net in self._deny if net.version == form.version):
                return f"{label} is in a network this deployment denies"
        if any(form in net for form in forms for net in self._allow if net.version == form.version):
            return None
        for form in forms:
            if form.is_multicast or not form.is_global:
                return f"{label} is {_describe(form)}, which this deployment does not allow"
        return None

    def check_url(self, url: str) -> httpx.URL:
        """`parse_url` with this policy's schemes; an IP address as the host is checked here too."""
        parsed = parse_url(url, self.schemes)
        if (literal := _ip_literal(parsed.host)) is not None and (problem := self.address_problem(literal)):
            raise UrlRefused(problem)
        return parsed

    async def resolve(
        self, url: str | httpx.URL, resolver: Resolver | None = None, *, timeout: float | None = None
    ) -> Pinned:
        """Check the URL's form, resolve its host and check every address; the request to make, pinned to the first
        address. A host that does not resolve (within ``timeout`` seconds, when given), or resolves to any address
        the policy does not allow, is UrlRefused (all of them are checked: a name with one public and one private
        address could be connected either way)."""
        parsed = self.check_url(str(url))
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        literal = _ip_literal(parsed.host)
        if literal is not None:
            return Pinned(parsed, str(literal))
        try:
            addresses = list(await asyncio.wait_for((resolver or system_resolver)(parsed.host, port), timeout))
        except (OSError, UnicodeError) as err:  # TimeoutError (wait_for's) is an OSError
            why = f"no answer within {timeout:g}s" if isinstance(err, TimeoutError) and timeout is not None else err
            raise UrlRefused(f"the host {parsed.host!r} does not resolve ({why})") from None
        if not addresses:
            raise UrlRefused(f"the host {parsed.host!r} does not resolve")
        for address in addresses:
            if (problem := self.address_problem(address)) is not None:
                raise UrlRefused(f"the host {parsed.host!r} resolves to {problem}")
        return Pinned(parsed, addresses[0])

    def resolve_sync(self, url: str, resolver: Resolver | None = None, *, timeout: float = DNS_TIMEOUT_S) -> Pinned:
        """`resolve` for a thread with no event loop running (the API's waiting threads, a sync route), within
        ``timeout`` seconds; a lookup still running then is left to finish in its own thread."""
        return asyncio.run(self.resolve(url, resolver or _threaded_system_resolver, timeout=timeout))


@dataclass(frozen=True)
class Pinned:
    """A checked URL and the checked address its request must connect to."""

    url: httpx.URL
    address: str

    @property
    def request_url(self) -> httpx.URL:
        """The URL with the address as its host: the client connects there and resolves nothing."""
        return self.url.copy_with(host=self.address)

    @property
    def headers(self) -> dict[str, str]:
        """`Host` as the original URL's (name and, when not the scheme's default, port)."""
        return {"Host": self.url.netloc.decode("ascii")}

    @property
    def extensions(self) -> dict[str, Any]:
        """For HTTPS, the TLS server name and the certificate's expected name: the URL's host, not the address."""
        return {"sni_hostname": self.url.host} if self.url.scheme == "https" else {}


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses `getaddrinfo` gives for a TCP connection to host:port, in its order, without repeats."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return _addresses(infos)


async def _threaded_system_resolver(host: str, port: int) -> list[str]:
    """`system_resolver` on `_DNS_THREADS`."""
    lookup = _DNS_THREADS.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    infos = await asyncio.wrap_future(lookup)
    return _addresses(infos)


def _addresses(infos: Sequence[tuple[Any, ...]]) -> list[str]:
    """getaddrinfo's addresses in its order, without repeats or an IPv6 scope."""
    return list(dict.fromkeys(str(info[4][0]).split("%", 1)[0] for info in infos))


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _describe(ip: IPAddress) -> str:
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_unspecified:
        return "an unspecified address"
    if ip.is_private:
        return "a private address"
    return "not a globally routable address"
