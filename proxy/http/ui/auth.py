"""Who may see the page: whoever holds the trainer token, as an `Authorization: Bearer` header or as the session
cookie the login form sets.

The cookie holds no token: it holds an HMAC of a fixed label keyed by the token, so it opens the page and nothing
else (not /api), and a new token ends every session. It is HttpOnly (no script reads it), SameSite=Strict (no other
site's page or form sends it) and Secure on https. The token comes in a POST body only, never a URL, so it is never
in an access log. A form POST from another origin is refused even so. Like /api, the page is not served on the
sandboxes' Unix socket: an agent must not answer its own calls.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

from proxy.core.errors import Forbidden
from proxy.core.keys import same_secret
from proxy.http.edge import parse_bearer
from proxy.http.metrics import on_sandbox_socket

COOKIE = "trajproxy_ui"
_LABEL = b"trajproxy /ui session"
_SESSION_S = 7 * 86400


class LoginNeeded(Exception):
    """The request holds neither the token nor the session cookie: the handler sends a browser to the login form."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


class UiAuth:
    def __init__(self, token: str | None) -> None:
        self._token = token
        self._session = hmac.new(token.encode(), _LABEL, hashlib.sha256).hexdigest() if token else None

    @property
    def open(self) -> bool:
        """No token is set (`--no-trainer-token`): the page is open, as /api is."""
        return self._token is None

    def check(self, request: Request) -> None:
        """Let the request through, or raise LoginNeeded, or Forbidden (the sandbox socket; a cross-site POST)."""
        if on_sandbox_socket(request):
            raise Forbidden("the page is not served on the sandbox socket; use trajproxy's TCP address")
        if request.method == "POST" and not _same_origin(request):
            raise Forbidden("a form posted from another site is refused")
        if self._token is None or self._session is None:
            return
        given = parse_bearer(request.headers.get("authorization"))
        if given is not None and same_secret(given, self._token):
            return
        cookie = request.cookies.get(COOKIE)
        if cookie is not None and same_secret(cookie, self._session):
            return
        raise LoginNeeded(request.url.path)

    def log_in(self, given: str, response: Response, request: Request) -> bool:
        """Set the session cookie on `response` if `given` is the token; whether it was."""
        if self._token is None or self._session is None or not same_secret(given.strip(), self._token):
            return False
        response.set_cookie(
            COOKIE,
            self._session,
            max_age=_SESSION_S,
            path="/ui",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return True

    @staticmethod
    def log_out(response: Response) -> None:
        response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")


def local_path(target: str | None) -> str:
    """Where to go after logging in: a path on this server under /ui, never another site."""
    if not target or not target.startswith("/ui") or target.startswith("//") or "\\" in target:
        return "/ui/"
    return target


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    if origin == "null":  # the page's Referrer-Policy (no-referrer) makes browsers send this on their own forms too
        return request.headers.get("sec-fetch-site") == "same-origin"
    if origin is None:  # browsers send an Origin with every cross-site POST
        return True
    return urlsplit(origin).netloc == request.headers.get("host")
