"""Who may see the page: whoever holds the trainer token, as an `Authorization: Bearer` header or as the session
cookie the login form sets.

The cookie holds no token: it holds a random session id, one per login, kept in this process's memory (a bounded
number, oldest forgotten first; a restart ends them all) until it expires or its holder logs out. It opens the page
and nothing else (not /api). It is HttpOnly (no script reads it), SameSite=Strict (no other site's page or form
sends it) and Secure on https. The token comes in a POST body only, never a URL, so it is never in an access log. A
form POST from another origin is refused even so, logging out too. Like /api, the page is not served on the
sandboxes' Unix socket: an agent must not answer its own calls.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

from proxy.core.errors import Forbidden
from proxy.core.values import same_secret
from proxy.http.edge import from_sandbox, parse_bearer

COOKIE = "trajproxy_ui"
_SESSION_S = 7 * 86400
SESSIONS_KEPT = 1000  # logins remembered at once; the oldest is logged out past that


class LoginNeeded(Exception):
    """The request holds neither the token nor the session cookie: the handler sends a browser to the login form."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


class UiAuth:
    def __init__(self, token: str | None) -> None:
        self._token = token
        self._sessions: OrderedDict[str, float] = OrderedDict()  # session id -> when it expires (monotonic s)

    @property
    def open(self) -> bool:
        """No token is set (`--no-trainer-token`): the page is open, as /api is."""
        return self._token is None

    def check(self, request: Request) -> None:
        """Let the request through, or raise LoginNeeded, or Forbidden (the sandbox socket; a cross-site POST)."""
        check_door(request)
        if self._token is None:
            return
        given = parse_bearer(request.headers.get("authorization"))
        if given is not None and same_secret(given, self._token):
            return
        if self._in_session(request.cookies.get(COOKIE)):
            return
        raise LoginNeeded(request.url.path)

    def _in_session(self, cookie: str | None) -> bool:
        if not cookie or (expires := self._sessions.get(cookie)) is None:
            return False
        if expires > time.monotonic():
            return True
        del self._sessions[cookie]
        return False

    def log_in(self, given: str, response: Response, request: Request) -> bool:
        """Start a session and set its cookie on `response` if `given` is the token; whether it was."""
        if self._token is None or not same_secret(given.strip(), self._token):
            return False
        session = secrets.token_urlsafe(32)
        self._sessions[session] = time.monotonic() + _SESSION_S
        while len(self._sessions) > SESSIONS_KEPT:
            self._sessions.popitem(last=False)
        response.set_cookie(
            COOKIE,
            session,
            max_age=_SESSION_S,
            path="/ui",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return True

    def log_out(self, request: Request, response: Response) -> None:
        """End the request's session (its cookie opens nothing from now on) and delete its cookie."""
        check_door(request)
        self._sessions.pop(request.cookies.get(COOKIE) or "", None)
        response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")


def check_door(request: Request) -> None:
    """Forbidden on the sandbox socket, and for a form posted from another site; before any token is looked at."""
    if from_sandbox(request.scope):
        raise Forbidden("the page is not served on the sandbox socket; use trajproxy's TCP address")
    if request.method == "POST" and not _same_origin(request):
        raise Forbidden("a form posted from another site is refused")


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
