"""The form of a URL a tenant names (an `endpoint` grader's, a tool server's): checked where it arrives, before any
address is looked up. Whether the deployment lets its host be reached is `trainer.grading.url_policy`'s check."""

from __future__ import annotations

from collections.abc import Sequence

import httpx

SCHEMES = ("http", "https")
MAX_URL_CHARS = 2048


class UrlRefused(ValueError):
    """A URL the policy does not allow; the message says why (and names the address when it is the address)."""


def parse_url(url: str, schemes: Sequence[str] = SCHEMES) -> httpx.URL:
    """The parsed URL when its form is allowed: an absolute URL with one of `schemes`, a host, no user name or
    password and no fragment, at most MAX_URL_CHARS long. UrlRefused says why not. Its addresses are not checked."""
    if len(url) > MAX_URL_CHARS:
        raise UrlRefused(f"longer than {MAX_URL_CHARS} characters")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as err:
        raise UrlRefused(f"not a valid URL ({err})") from None
    if parsed.scheme not in schemes:
        allowed = " or ".join(f"{s}://" for s in schemes)
        raise UrlRefused(f"the URL must start with {allowed}")
    if not parsed.host:
        raise UrlRefused("the URL has no host")
    if parsed.userinfo:
        raise UrlRefused("the URL may not hold a user name or password; send credentials in headers")
    if parsed.fragment:
        raise UrlRefused("the URL may not have a #fragment")
    return parsed
