"""FastLane: the trainer's share of every turn (a batch pull, a batch reply), as plain ASGI ahead of FastAPI.

Each turn is one agent call (`proxy.http.agent`), and a share of one trainer pull and one batch reply. Those
skip FastAPI's routing, dependency solving and exception layers (about half the server's CPU per turn when
they went through it), and a batch reply's body is decoded into msgspec Structs (`proxy.schema.replies`), not
pydantic models. A trainer request whose query or body does not validate goes on to its FastAPI route, which
answers with the usual 422 and is also what the OpenAPI schema describes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import parse_qsl

import msgspec
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy import schema
from proxy.core.broker import Broker
from proxy.core.errors import TrajproxyError
from proxy.http.edge import error_body, read_body, replay, respond, status_of
from proxy.http.trainer import next_batch, reply_batch
from proxy.schema import replies
from proxy.settings import Settings

# The batch reply's body, decoded into Structs; what they refuse goes to the route, whose pydantic model may
# accept it (`5.0` for an integer) or says what is wrong
_REPLIES = msgspec.json.Decoder(replies.ReplyBatch)


class FastLane:
    def __init__(self, app: ASGIApp, broker: Broker, settings: Settings) -> None:
        self._app = app
        self._broker = broker
        self._max_body_bytes = settings.max_body_bytes
        self._trainer: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            ("GET", "/api/turns/next"): self._next_turns,
            ("POST", "/api/turns/replies"): self._replies,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (route := self._trainer.get((scope["method"], scope["path"]))) is not None:
            await route(scope, receive, send)
        else:
            await self._app(scope, receive, send)

    async def _next_turns(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            query = schema.TurnsQuery.model_validate(_query(scope))
        except ValidationError:
            await self._app(scope, receive, send)
            return
        try:
            status, body = await next_batch(self._broker, query, receive)
        except TrajproxyError as e:
            status, body = status_of(e), error_body(e.kind, e.message)
        await respond(send, status, body)

    async def _replies(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            raw = await read_body(scope, receive, self._max_body_bytes)
        except TrajproxyError as e:
            await respond(send, status_of(e), error_body(e.kind, e.message))
            return
        try:
            batch = _REPLIES.decode(raw)
            query = schema.RepliesQuery.model_validate(_query(scope))
        except (msgspec.ValidationError, msgspec.DecodeError, ValidationError):
            await self._app(scope, replay(raw, receive), send)
            return
        try:
            status, body = await reply_batch(self._broker, batch, query, receive)
        except TrajproxyError as e:
            status, body = status_of(e), error_body(e.kind, e.message)
        await respond(send, status, body)


def _query(scope: Scope) -> dict[str, str]:
    return dict(parse_qsl(scope["query_string"].decode("latin-1"), True))
