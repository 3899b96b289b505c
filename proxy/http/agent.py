"""The agent-facing routes: what unmodified agents call, under /v1 and /e/<key>/v1.

Every turn crosses these, so they are plain ASGI handlers, dispatched first thing (see `proxy.app`), with no
framework layers between the server and the broker.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Receive, Scope, Send

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

Handler = Callable[[str | None, Scope, Receive, Send], Awaitable[None]]  # the key in the path first
Continuation = Callable[[Episode, JsonObject, Call], Awaitable[Call]]
MODELS = b'{"object":"list","data":[{"id":"trajproxy","object":"model","created":0,"owned_by":"trajproxy"}]}'
GEMINI_PREFIXES = ("/v1beta/models/", "/v1/models/")  # then {model}:{method}


async def refuse(send: Send, dialect: Dialect, error: TrajproxyError) -> None:
    """An error for an agent, in its dialect's shape, with its retry advice."""
    status = status_of(error)
    await respond(send, status, dialect.error_body(status, error.kind, error.message), [*JSON, *error_headers(error)])


class AgentRoutes:
    """The routes agents call, by path (after an optional /e/<key> prefix) and method."""

    def __init__(self, broker: Broker, settings: Settings) -> None:
        self._broker = broker
        self._settings = settings
        chat, self._anthropic, self._responses = ChatDialect(), AnthropicDialect(), ResponsesDialect()
        self._counting = CountTokens(broker, settings.max_body_bytes)
        self._routes: dict[str, tuple[str, Dialect, Handler]] = {
            "/v1/chat/completions": ("POST", chat, self._calls(chat)),
            "/v1/messages": ("POST", self._anthropic, self._calls(self._anthropic)),
            "/v1/responses": ("POST", self._responses, self._calls(self._responses, self._continue_response)),
            "/v1/messages/count_tokens": ("POST", self._anthropic, partial(self._counting, self._anthropic)),
            "/v1/models": ("GET", chat, self._models),
        }

    def route(self, scope: Scope) -> ASGIApp | None:
        """The handler for the request, if its path is an agent route; None if it is not (another app's to serve)."""
        path: str = scope["path"]
        key: str | None = None
        if path.startswith("/e/"):
            key, _, rest = path[3:].partition("/")
            path = "/" + rest
        route = self._routes.get(path)
        if route is None and path.startswith(GEMINI_PREFIXES) and ":" in path:
            query = dict(parse_qsl(scope["query_string"].decode("latin-1")))
            route = self._gemini(path, query)
            key = key or query.get("key")  # Google's SDKs may send the key as a query parameter
        if route is None:
            return None
        method, dialect, handler = route
        if scope["method"] != method:
            return partial(_not_allowed, dialect, method)
        return partial(handler, key)

    def _calls(self, dialect: Dialect, continued: Continuation | None = None) -> Handler:
        broker, settings = self._broker, self._settings

        async def call(key: str | None, scope: Scope, receive: Receive, send: Send) -> None:
            headers: Mapping[bytes, bytes] = dict(scope["headers"])
            try:
                episode = await broker.authenticate(agent_key(key, headers))
                raw, body = await read_json(scope, receive, settings.max_body_bytes)
                parsed = dialect.parse(body)
                if continued is not None:
                    parsed = await continued(episode, body, parsed)
                retry = headers.get(b"x-stainless-retry-count", b"0") not in (b"", b"0")
                slot = await broker.park(
                    episode.id, dialect.name, parsed.request, raw, stream=parsed.stream, retry=retry
                )
            except TrajproxyError as e:
                await refuse(send, dialect, e)
                return
            await ParkedReply(broker, dialect, parsed, slot, episode, settings.keepalive_s)(scope, receive, send)

        return call

    def _gemini(self, path: str, query: Mapping[str, str]) -> tuple[str, Dialect, Handler]:
        """The route of a Gemini API call, `/v1beta/models/{model}:{method}`: a dialect for its model and method."""
        model, _, method = path.split("/models/", 1)[1].rpartition(":")
        dialect = GeminiDialect(model=model or "trajproxy", method=method, sse=query.get("alt") == "sse")
        if method == "countTokens":
            return "POST", dialect, partial(self._counting, dialect)
        if method in METHODS:
            return "POST", dialect, self._calls(dialect)
        return "POST", dialect, partial(_no_method, dialect, method)

    async def _models(self, _key: str | None, _scope: Scope, _receive: Receive, send: Send) -> None:
        await respond(send, 200, MODELS)

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


async def _not_allowed(dialect: Dialect, allowed: str, scope: Scope, _receive: Receive, send: Send) -> None:
    message = f"{scope['method']} is not allowed on {redact(scope['path'])}; use {allowed}"
    body = dialect.error_body(405, "invalid_request_error", message)
    await respond(send, 405, body, [*JSON, (b"allow", allowed.encode())])


async def _no_method(dialect: Dialect, method: str, _key: str | None, _s: Scope, _r: Receive, send: Send) -> None:
    message = f"trajproxy does not serve the Gemini API method {method!r}; it serves {', '.join(METHODS)}"
    await respond(send, 404, dialect.error_body(404, NotFound.kind, message))
