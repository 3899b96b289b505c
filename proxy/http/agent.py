"""The agent-facing handlers: what unmodified agents call, under /v1 and /e/<key>/v1 (the route table,
`proxy.http.routes`, names their paths).

Every turn crosses these, so they are plain ASGI handlers, reached straight from the route table, with no
framework layers between the server and the broker. Each has the dialect its errors are shaped in (`dialect`),
which the table's 405 uses too. The key in the path (`/e/<key>`) and Gemini's `{model}:{method}` come in
`scope["path_params"]`.

A parked call's exchange is held open by `ParkedReply` while its turn waits: the turn's life meanwhile (the turn
timeout, a hang-up and its retry grace) is the broker's (`Broker.attend`); this renders what the agent hears, in its
dialect: keep-alives, the reply, or an error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Protocol
from urllib.parse import parse_qsl

from starlette.types import Receive, Scope, Send

from proxy.core.broker import Broker
from proxy.core.errors import NotFound, TrajproxyError
from proxy.core.open_turns import OpenTurn
from proxy.core.values import Episode, JsonObject, Turn
from proxy.dialects.anthropic import AnthropicDialect
from proxy.dialects.chat import ChatDialect
from proxy.dialects.dialect import Call, Dialect
from proxy.dialects.gemini import METHODS, GeminiDialect
from proxy.dialects.responses import ResponsesDialect
from proxy.http import prefix
from proxy.http.counting import CountTokens
from proxy.http.edge import JSON, agent_key, disconnected, error_headers, parse_json, read_chunks, respond, status_of
from proxy.settings import Settings

Continuation = Callable[[Episode, JsonObject, Call], Awaitable[Call]]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
MODELS = b'{"object":"list","data":[{"id":"trajproxy","object":"model","created":0,"owned_by":"trajproxy"}]}'


class AgentHandler(Protocol):
    """A plain ASGI handler of an agent route, with the dialect its errors (and its route's 405) are shaped in."""

    @property
    def dialect(self) -> Dialect: ...

    async def __call__(self, scope: Scope, receive: Receive, send: Send, /) -> None: ...


async def refuse(send: Send, dialect: Dialect, error: TrajproxyError) -> None:
    """An error for an agent, in its dialect's shape, with its retry advice."""
    status = status_of(error)
    await respond(send, status, dialect.error_body(status, error.kind, error.message), [*JSON, *error_headers(error)])


def path_key(scope: Scope) -> str | None:
    """The episode key the path carried (`/e/<key>/...`), if it did."""
    key: str | None = scope["path_params"].get("key")
    return key


Failure = tuple[int, str, str, list[tuple[bytes, bytes]]]


class ParkedReply:
    __slots__ = ("_broker", "_call", "_dialect", "_episode", "_keepalive_s", "_open_turn")  # one per parked call

    def __init__(
        self, broker: Broker, dialect: Dialect, call: Call, open_turn: OpenTurn, episode: Episode, keepalive_s: float
    ) -> None:
        self._broker = broker
        self._dialect = dialect
        self._call = call
        self._open_turn = open_turn
        self._episode = episode
        self._keepalive_s = keepalive_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.ensure_future(disconnected(receive))
        try:
            with self._broker.attend(self._open_turn, self._episode):
                if self._call.stream:
                    await self._stream(send, gone)
                else:
                    await self._plain(send, gone)
        finally:
            gone.cancel()

    async def _plain(self, send: Send, gone: asyncio.Future[None]) -> None:
        answer = self._open_turn.answer
        await _either(answer, gone)
        if not answer.done():
            return
        if (failure := self._failure(answer)) is not None:
            await self._refuse(send, failure)
        else:
            await respond(send, 200, self._dialect.render(self._call, answer.result()))
        self._handed_over(answer)

    async def _stream(self, send: Send, gone: asyncio.Future[None]) -> None:
        answer = self._open_turn.answer
        started = False
        while not answer.done():
            await asyncio.wait((answer, gone), timeout=self._keepalive_s, return_when=asyncio.FIRST_COMPLETED)
            if gone.done():
                return
            if not answer.done():
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": SSE})
                    started = True
                await send({"type": "http.response.body", "body": self._dialect.keepalive, "more_body": True})
        failure = self._failure(answer)
        if not started:
            if failure is not None:  # nothing sent yet: a proper error status, not an event
                await self._refuse(send, failure)
                self._handed_over(answer)
                return
            await send({"type": "http.response.start", "status": 200, "headers": SSE})
        if failure is not None:
            status, kind, message, _ = failure
            body = self._dialect.stream_error(status, kind, message)
        else:
            body = b"".join(self._dialect.render_stream(self._call, answer.result()))
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self._handed_over(answer)

    def _handed_over(self, answer: asyncio.Future[Turn]) -> None:
        """Tell the broker the reply is with the agent's connection (an error a trainer chose counts too)."""
        if not answer.cancelled() and answer.exception() is None:
            self._broker.handed_over(answer.result())

    @staticmethod
    def _failure(answer: asyncio.Future[Turn]) -> Failure | None:
        """Why the agent gets an error instead of the reply (status, kind, message, headers); None if it does not."""
        error = answer.exception()
        if isinstance(error, TrajproxyError):
            return status_of(error), error.kind, error.message, [*JSON, *error_headers(error)]
        if error is not None:
            raise error
        reply = answer.result().reply
        assert reply is not None
        if reply.error is not None:  # the trainer's own error: the SDK's retry rules apply
            return reply.error.status, reply.error.kind, reply.error.message, JSON
        return None

    async def _refuse(self, send: Send, failure: Failure) -> None:
        status, kind, message, headers = failure
        await respond(send, status, self._dialect.error_body(status, kind, message), headers)


def _either(a: asyncio.Future[Any], b: asyncio.Future[Any]) -> asyncio.Future[None]:
    """A future done once one of two futures is done: asyncio.wait's work without its generality, which costs
    several times more and runs once per turn. A plain function, not a coroutine: a parked call holds no frame of it
    for as long as it waits; the first to finish takes the waits off both."""
    woken = asyncio.get_running_loop().create_future()
    wake = _Wake(a, b, woken)
    a.add_done_callback(wake)
    b.add_done_callback(wake)
    return woken


class _Wake:
    """`_either`'s callback. An object, not a closure: a closure that takes itself off the futures names itself, a
    cycle (the function, its cell, the function) that holds both futures, and so the turn answered and its call, until
    the collector's next full pass (minutes apart while serving: `proxy.cli.serve.GC_THRESHOLDS`). Once it has run,
    nothing refers back to it, and all of it is freed as the call ends."""

    __slots__ = ("a", "b", "woken")

    def __init__(self, a: asyncio.Future[Any], b: asyncio.Future[Any], woken: asyncio.Future[None]) -> None:
        self.a, self.b, self.woken = a, b, woken

    def __call__(self, _: object) -> None:
        self.a.remove_done_callback(self)
        self.b.remove_done_callback(self)
        if not self.woken.done():
            self.woken.set_result(None)


class AgentCall:
    """A call that parks a turn: parsed in its dialect, then held open until the turn's outcome (`ParkedReply`)."""

    def __init__(self, broker: Broker, settings: Settings, dialect: Dialect, continued: Continuation | None = None):
        self.dialect = dialect
        self._broker = broker
        self._settings = settings
        self._continued = continued

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Coroutine[Any, Any, None]:
        return self.serve(self.dialect, path_key(scope), scope, receive, send)  # no frame of its own while parked

    async def serve(self, dialect: Dialect, key: str | None, scope: Scope, receive: Receive, send: Send) -> None:
        broker, settings = self._broker, self._settings
        headers: Mapping[bytes, bytes] = dict(scope["headers"])
        try:
            episode = await broker.authenticate(agent_key(key, headers))
            raw = await read_chunks(scope, receive, settings.max_body_bytes)
            live = broker.live(episode.id)
            known = live.last_body if live is not None and self._continued is None else None
            extended = prefix.extend(known, raw, dialect) if known is not None else None
            if extended is not None:
                parsed, raw = extended.call, extended.wire
            else:
                raw = bytes(raw)  # read whole: joined, once (a continued call's: the earlier's bytes, then its own)
                body = parse_json(raw)
                parsed = dialect.parse(body)
                if self._continued is not None:
                    parsed = await self._continued(episode, body, parsed)
            said = headers.get(b"x-stainless-retry-count")  # absent: the client does not say (None)
            retry = None if said is None else said not in (b"", b"0")
            extension = extended.extension if extended is not None else None
            open_turn = await broker.park(
                episode.id, dialect.name, parsed.request, raw, stream=parsed.stream, retry=retry, extension=extension
            )
        except TrajproxyError as e:
            await refuse(send, dialect, e)
            return
        if live is not None and open_turn.turn.wire is raw and self._continued is None:  # a new turn of this call's
            small = len(raw) < prefix.EXTEND_FROM  # (no call into prefix.py for these: its only rule is this one)
            live.last_body = None if small else prefix.remember(open_turn.turn.id, dialect, raw, parsed, extended)
        await ParkedReply(broker, dialect, parsed, open_turn, episode, settings.keepalive_s)(scope, receive, send)


class Count:
    """A count of a call's tokens, in one dialect (`CountTokens` bounds them per episode, whatever the dialect)."""

    def __init__(self, counting: CountTokens, dialect: AnthropicDialect) -> None:
        self.dialect = dialect
        self._counting = counting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._counting(self.dialect, path_key(scope), scope, receive, send)


class Models:
    """The one model an agent may ask for: trajproxy's."""

    dialect: Dialect = ChatDialect()

    async def __call__(self, _scope: Scope, _receive: Receive, send: Send) -> None:
        await respond(send, 200, MODELS)


class Gemini:
    """A Gemini API call, `/v1beta/models/{model}:{method}`: a dialect for its model and method (the key may also
    come as the `key` query parameter, as Google's SDKs may send it)."""

    dialect: Dialect = GeminiDialect()  # the shape of its errors, whatever the model and method

    def __init__(self, broker: Broker, settings: Settings, counting: CountTokens) -> None:
        self._call = AgentCall(broker, settings, self.dialect)
        self._counting = counting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        params = scope["path_params"]
        model, method = params["model"], params["method"]
        query = dict(parse_qsl(scope["query_string"].decode("latin-1")))
        dialect = GeminiDialect(model=model or "trajproxy", method=method, sse=query.get("alt") == "sse")
        key = path_key(scope) or query.get("key")
        if method == "countTokens":
            await self._counting(dialect, key, scope, receive, send)
        elif method in METHODS:
            await self._call.serve(dialect, key, scope, receive, send)
        else:
            message = f"trajproxy does not serve the Gemini API method {method!r}; it serves {', '.join(METHODS)}"
            await respond(send, 404, dialect.error_body(404, NotFound.kind, message))


class AgentCalls:
    """The handlers of every agent route, over one broker."""

    def __init__(self, broker: Broker, settings: Settings) -> None:
        self._broker = broker
        self._responses = ResponsesDialect()
        counting = CountTokens(broker, settings.max_body_bytes)
        anthropic = AnthropicDialect()
        self.chat = AgentCall(broker, settings, ChatDialect())
        self.messages = AgentCall(broker, settings, anthropic)
        self.responses = AgentCall(broker, settings, self._responses, self._continue_response)
        self.count_tokens = Count(counting, anthropic)
        self.models = Models()
        self.gemini = Gemini(broker, settings, counting)

    async def _continue_response(self, episode: Episode, body: JsonObject, parsed: Call) -> Call:
        """With previous_response_id, the earlier turn of this episode that the call continues."""
        previous_id = self._responses.previous_turn_id(body)
        if previous_id is None:
            return parsed
        try:
            previous = await self._broker.queue.turn(previous_id)
        except NotFound:
            previous = None
        if previous is None or previous.episode_id != episode.id:
            raise NotFound(f"previous response resp_{previous_id} is not a response of this episode")
        return self._responses.continue_from(parsed, previous)
