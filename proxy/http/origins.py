"""Callers: who may use a trainer API opened with `--no-trainer-token`, which has no secret to ask for. A request
must name one host, a loopback one (or `--public-url`'s), so a web page on a name pointed at this machine (DNS
rebinding) is refused; no browser may say that another origin's page sent it (`Origin`, `Sec-Fetch-Site`), and a
browser that says neither (one older than Fetch Metadata, whose cross-site GETs carry no `Origin`) may not call the
API at all. A program (curl, the trainer's client) sends neither and does not call itself a browser: it passes."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from proxy.core.errors import BadRequest, Forbidden

OPEN = "trajproxy has no trainer token (--no-trainer-token)"
_BROWSER = b"mozilla/"  # how every browser's User-Agent opens, and no HTTP library's


def one_host(raw: Iterable[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """A request's headers by name; BadRequest for one naming two hosts (HTTP has a server refuse it with 400:
    which of the two a check reads and which the routing before it read is what a forged request plays on)."""
    headers: dict[bytes, bytes] = {}
    for name, value in raw:
        if name == b"host" and name in headers:
            raise BadRequest(f"{OPEN}: a request names one Host; this one names more than one")
        headers.setdefault(name, value)
    return headers


class LocalCallers:
    """The hosts an open trainer API answers to: loopback addresses, `localhost`, and `--public-url`'s."""

    def __init__(self, public_url: str | None = None) -> None:
        self._public_host = urlsplit(public_url).hostname if public_url else None

    def check(self, raw: Iterable[tuple[bytes, bytes]], *, api: bool) -> None:
        """Refuse (BadRequest, Forbidden) a request the open trainer API (`api`) or an open route (the page, the
        docs, metrics: a browser's to load) must not answer."""
        headers = one_host(raw)
        if (foreign := self.foreign_host(headers) or (self.foreign_page(headers) if api else None)) is not None:
            raise Forbidden(foreign)

    def foreign_host(self, headers: Mapping[bytes, bytes]) -> str | None:
        """Why a request naming another host than a local one is refused (None: it names a local one, or none)."""
        host = headers.get(b"host")
        if host is None or self._local(host.decode("latin-1")):
            return None
        named = _shown(host)
        return f"{OPEN}: it answers requests to 127.0.0.1, ::1, localhost or --public-url's host, not to {named}"

    def foreign_page(self, headers: Mapping[bytes, bytes]) -> str | None:
        """Why a request a browser says came from another origin's page is refused (None: it did not)."""
        origin, site = headers.get(b"origin"), headers.get(b"sec-fetch-site")
        if site is not None and site not in (b"same-origin", b"none"):  # "none": typed in the address bar
            foreign = True
        elif origin is None and site is None:  # a program's, or a browser's that names no page at all
            agent = headers.get(b"user-agent", b"").lower()
            if agent.startswith(_BROWSER):
                return (
                    f"{OPEN}: a browser that sends neither Origin nor Sec-Fetch-Site may not call it (every current "
                    "browser sends Sec-Fetch-Site); use a current browser, or start trajproxy with a trainer token"
                )
            foreign = False
        elif origin is None:  # a same-origin GET
            foreign = False
        elif origin == b"null":  # a sandboxed frame or a file; the page's own forms too (its Referrer-Policy)
            foreign = site != b"same-origin"
        else:  # the page's own origin is the host it called
            host = headers.get(b"host", b"").decode("latin-1").lower()
            foreign = _netloc(origin.decode("latin-1")) != host
        return f"{OPEN}: a web page of another origin may not call it" if foreign else None

    def _local(self, host: str) -> bool:
        try:
            name = urlsplit(f"//{host}").hostname
        except ValueError:  # a port that is not one
            return False
        if name is None:
            return False
        if name in ("localhost", self._public_host):
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False


def _netloc(url: str) -> str | None:
    try:
        return urlsplit(url).netloc.lower()
    except ValueError:  # not a URL: no origin of this server's
        return None


def _shown(host: bytes) -> str:
    """A Host header as a message may show it: printable, and short."""
    text = host.decode("latin-1")
    return repr(text[:80]) if text.isprintable() else "another name"
