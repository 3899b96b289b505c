"""TrainerDoor: the trainer API's door (`Door.TRAINER`); the token (or, with none, that no web page sent the request:
`proxy.http.origins`), the query's names, the body's size, type (JSON) and nesting are checked before any route reads
the body or waits. The route table (`proxy.http.routes`) sends every route whose door is the trainer's through it."""

from __future__ import annotations

import contextlib

import orjson
from starlette.types import Receive, Scope, Send

from proxy.core.errors import BadRequest, Forbidden, TrajproxyError, Unauthorized
from proxy.core.keys import same_secret
from proxy.http.edge import (
    TOO_DEEP,
    deny,
    error_body,
    may_nest_too_deep,
    nested_too_deep,
    parse_bearer,
    read_body,
    replay,
    status_of,
)
from proxy.http.origins import LocalCallers
from proxy.http.queries import DeclaredQueries
from proxy.http.sandbox_door import from_sandbox


class TrainerDoor:
    def __init__(
        self, token: str | None, max_body_bytes: int, queries: DeclaredQueries, callers: LocalCallers | None = None
    ) -> None:
        self._token = token
        self._max_body_bytes = max_body_bytes
        self._queries = queries
        self._callers = callers or LocalCallers()

    async def admit(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """Check an HTTP request at the door and read its body: what its route reads the body from, or None once
        the request has been refused."""
        try:
            self._check_door(scope)
            unknown = self._queries.refusal(scope["method"], scope["path"], scope["query_string"])
        except TrajproxyError as e:
            await self._drain(scope, receive)
            await _refuse(send, status_of(e), e.kind, e.message)
            return None
        if unknown is not None:
            await self._drain(scope, receive)
            await _refuse(send, 422, BadRequest.kind, unknown)  # FastAPI's status for a query it cannot take
            return None
        try:
            body = await read_body(scope, receive, self._max_body_bytes)
            if body and not declared_json(scope):
                await _refuse(send, 415, BadRequest.kind, NOT_JSON)
                return None
            if too_deep(body):
                raise BadRequest(TOO_DEEP)
        except TrajproxyError as e:
            await _refuse(send, status_of(e), e.kind, e.message)
            return None
        return replay(body, receive)

    async def admit_open(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Check a request to an open route (the page, the docs, metrics): with no token, the page is as open as the
        API, so it too answers only requests to a local host. False once it has been refused."""
        if self._token is not None or (foreign := self._callers.foreign_host(dict(scope["headers"]))) is None:
            return True
        await self._drain(scope, receive)
        await _refuse(send, 403, Forbidden.kind, foreign)
        return False

    async def admit_handshake(self, scope: Scope, send: Send) -> bool:
        """Check a WebSocket handshake (the trainer's stream) before it is accepted; its query is the stream's own
        to check. False once it has been refused."""
        try:
            self._check_door(scope)
        except TrajproxyError as e:
            await deny(scope, send, status_of(e), error_body(e.kind, e.message))
            return False
        return True

    async def _drain(self, scope: Scope, receive: Receive) -> None:
        """Read and drop the body of a request refused before it was read (up to the body limit, and as long as it
        does not stall): a connection closed with a body still arriving is reset, and the reset can reach the client
        before it has read the refusal."""
        with contextlib.suppress(TrajproxyError):
            await read_body(scope, receive, self._max_body_bytes)

    def _check_door(self, scope: Scope) -> None:
        if from_sandbox(scope):  # the sandboxes' door, agents only
            raise Forbidden("the trainer API is not served on the sandbox socket; use trajproxy's TCP address")
        self._check_token(scope)

    def _check_token(self, scope: Scope) -> None:
        if self._token is None:  # nothing to show: a program on this machine may call, a web page may not
            headers = dict(scope["headers"])
            if (foreign := self._callers.foreign_host(headers) or self._callers.foreign_page(headers)) is not None:
                raise Forbidden(foreign)
            return
        given = parse_bearer(dict(scope["headers"]).get(b"authorization", b"").decode("latin-1"))
        if given is None or not same_secret(given, self._token):
            raise Unauthorized("the trainer API needs 'Authorization: Bearer <TRAJPROXY_TRAINER_TOKEN>'")


NOT_JSON = "the trainer API takes JSON bodies only: send 'Content-Type: application/json'"


def declared_json(scope: Scope) -> bool:
    """Whether the request says its body is JSON (`application/json`, or a `+json` type). A web page may send any
    other type, or none, to another origin without asking first (no CORS preflight)."""
    declared: bytes = dict(scope["headers"]).get(b"content-type", b"")
    media = declared.decode("latin-1").partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def too_deep(body: bytes) -> bool:
    """Whether the body is JSON nested deeper than MAX_JSON_DEPTH (malformed JSON is its route's to refuse)."""
    if not may_nest_too_deep(body):
        return False
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        return str(e).startswith("depth limit exceeded")
    return nested_too_deep(value)


async def _refuse(send: Send, status: int, kind: str, message: str) -> None:
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": error_body(kind, message)})
