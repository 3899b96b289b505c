"""The agent-facing handlers: what unmodified agents call, under /v1 and /e/<key>/v1 (the route table,
`proxy.http.routes`, names their paths).

Every turn crosses these, so they are plain ASGI handlers, reached straight from the route table, with no
framework layers between the server and the broker. Each has the dialect its errors are shaped in (`dialect`),
which the table's 405 uses too. The key in the path (`/e/<key>`) and Gemini's `{model}:{method}` come in
`scope["path_params"]`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol
from urllib.parse import parse_qsl

from starlette.types import Receive, Scope, Send

from proxy.core.broker import Broker
from proxy.core.errors import NotFound, TrajproxyError
from proxy.core.values import Episode, JsonObject
from proxy.dialects.anthropic import AnthropicDialect
from proxy.dialects.chat import ChatDialect
from proxy.dialects.dialect import Call, Dialect
from proxy.dialects.gemini import METHODS, GeminiDialect
from proxy.dialects.responses import ResponsesDialect
from proxy.http.counting import CountTokens
from proxy.http.edge import JSON, agent_key, error_headers, read_json, redact, respond, status_of
from proxy.http.parked import ParkedReply
from proxy.settings import Settings

Continuation = Callable[[Episode, JsonObject, Call], Awaitable[Call]]
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


async def not_allowed(dialect: Dialect, allowed: str, scope: Scope, send: Send) -> None:
    """405 for an agent route called with another method, in its dialect's shape."""
    message = f"{scope['method']} is not allowed on {redact(scope['path'])}; use {allowed}"
    body = dialect.error_body(405, "invalid_request_error", message)
    await respond(send, 405, body, [*JSON, (b"allow", allowed.encode())])


def path_key(scope: Scope) -> str | None:
    """The episode key the path carried (`/e/<key>/...`), if it did."""
    key: str | None = scope["path_params"].get("key")
    return key


class AgentCall:
    """A call that parks a turn: parsed in its dialect, then held open until the turn's outcome (`ParkedReply`)."""

    def __init__(self, broker: Broker, settings: Settings, dialect: Dialect, continued: Continuation | None = None):
        self.dialect = dialect
        self._broker = broker
        self._settings = settings
        self._continued = continued

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.serve(self.dialect, path_key(scope), scope, receive, send)

    async def serve(self, dialect: Dialect, key: str | None, scope: Scope, receive: Receive, send: Send) -> None:
        broker, settings = self._broker, self._settings
        headers: Mapping[bytes, bytes] = dict(scope["headers"])
        try:
            episode = await broker.authenticate(agent_key(key, headers))
            raw, body = await read_json(scope, receive, settings.max_body_bytes)
            parsed = dialect.parse(body)
            if self._continued is not None:
                parsed = await self._continued(episode, body, parsed)
            retry = headers.get(b"x-stainless-retry-count", b"0") not in (b"", b"0")
            slot = await broker.park(episode.id, dialect.name, parsed.request, raw, stream=parsed.stream, retry=retry)
        except TrajproxyError as e:
            await refuse(send, dialect, e)
            return
        await ParkedReply(broker, dialect, parsed, slot, episode, settings.keepalive_s)(scope, receive, send)


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
