"""TrainerGate: the trainer API's door; the token, the body size and its JSON nesting are checked before any route
reads the body."""

from __future__ import annotations

import json

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.core.errors import BadRequest, Forbidden, TrajproxyError, Unauthorized
from proxy.core.keys import same_secret
from proxy.http.edge import error_body, parse_bearer, read_body, replay, status_of

OPEN_PATHS = frozenset({"/api/docs", "/api/openapi.json"})  # the schema only; no data
MAX_JSON_DEPTH = 128  # well inside what storage's serialiser takes (orjson stops at 255 levels)
_PARSER_DEPTH = 1024  # how deep orjson.loads goes before it gives up (documented)


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
            if nested_deeper(body, MAX_JSON_DEPTH):
                raise BadRequest(f"request body nests JSON arrays and objects deeper than {MAX_JSON_DEPTH} levels")
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


def nested_deeper(body: bytes, limit: int) -> bool:
    """Whether the JSON in `body` nests arrays and objects more than `limit` levels deep. Such a body parses, but
    later fails where a serialiser gives up (a 500, or a 503 from storage)."""
    if body.count(b"[") + body.count(b"{") <= limit:  # the usual case: too few brackets to nest that deep
        return False
    # The parser, in C, does the counting: wrapped in (its depth - limit) arrays, the body is too deep for it
    # exactly when it nests more than `limit` levels, or when it is not JSON at all.
    padding = _PARSER_DEPTH - limit
    try:
        orjson.loads(b"[" * padding + body + b"]" * padding)
    except orjson.JSONDecodeError:
        return _json_too_deep(body)
    return False


def _json_too_deep(body: bytes) -> bool:
    """Whether a body the padded parse refused is JSON (only too deep) rather than malformed (its route says how)."""
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:
        try:
            json.loads(body)
        except RecursionError:
            return True  # deeper than either parser goes
        except ValueError:
            return False
        return False  # JSON that orjson does not take (NaN)
    return True


async def _refuse(send: Send, error: TrajproxyError) -> None:
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status_of(error), "headers": headers})
    await send({"type": "http.response.body", "body": error_body(error.kind, error.message)})
