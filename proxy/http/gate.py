"""TrainerGate: the trainer API's door; the token and the body size are checked before any route reads the body."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.core.errors import Forbidden, TrajproxyError, Unauthorized
from proxy.core.keys import same_secret
from proxy.http.edge import error_body, parse_bearer, read_body, replay, status_of

OPEN_PATHS = frozenset({"/api/docs", "/api/openapi.json"})  # the schema only; no data


class TrainerGate:
    """Pure ASGI (no BaseHTTPMiddleware): requests outside /api pass straight through."""

    def __init__(self, app: ASGIApp, token: str | None, max_body_bytes: int) -> None:
        self._app = app
        self._token = token
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/api/") or path in OPEN_PATHS:
            await self._app(scope, receive, send)
            return
        try:
            server = scope.get("server")
            if server is None or server[1] is None:  # a Unix socket (no port): the sandboxes' door, agents only
                raise Forbidden("the trainer API is not served on the sandbox socket; use trajproxy's TCP address")
            self._check_token(scope)
            body = await read_body(scope, receive, self._max_body_bytes)
        except TrajproxyError as e:
            await _refuse(send, e)
            return
        await self._app(scope, replay(body, receive), send)

    def _check_token(self, scope: Scope) -> None:
        if self._token is None:
            return
        given = parse_bearer(dict(scope["headers"]).get(b"authorization", b"").decode("latin-1"))
        if given is None or not same_secret(given, self._token):
            raise Unauthorized("the trainer API needs 'Authorization: Bearer <TRAJPROXY_TRAINER_TOKEN>'")


async def _refuse(send: Send, error: TrajproxyError) -> None:
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status_of(error), "headers": headers})
    await send({"type": "http.response.body", "body": error_body(error.kind, error.message)})
