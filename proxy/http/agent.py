"""The agent-facing routes: what unmodified agents call, under /v1 and /e/<key>/v1."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from proxy.core.broker import Broker
from proxy.core.errors import NotFound, TrajproxyError
from proxy.core.values import Episode, JsonObject
from proxy.dialects.anthropic import AnthropicDialect
from proxy.dialects.chat import ChatDialect
from proxy.dialects.dialect import Call, Dialect
from proxy.dialects.responses import ResponsesDialect
from proxy.http.edge import agent_key, error_headers, read_json, status_of
from proxy.http.parked import ParkedReply
from proxy.settings import Settings

Continuation = Callable[[Episode, JsonObject, Call], Awaitable[Call]]
MODELS = b'{"object":"list","data":[{"id":"trajproxy","object":"model","created":0,"owned_by":"trajproxy"}]}'


def refusal(dialect: Dialect, error: TrajproxyError) -> Response:
    """An error for an agent, in its dialect's shape, with its retry advice."""
    status = status_of(error)
    body = dialect.error_body(status, error.kind, error.message)
    return Response(body, status, headers=error_headers(error), media_type="application/json")


def agent_routes(broker: Broker, settings: Settings) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    def endpoint(dialect: Dialect, continued: Continuation | None = None):  # type: ignore[no-untyped-def]
        async def call(request: Request) -> Response:
            try:
                episode = await broker.authenticate(agent_key(request))
                raw, body = await read_json(request, settings.max_body_bytes)
                parsed = dialect.parse(body)
                if continued is not None:
                    parsed = await continued(episode, body, parsed)
                retry = request.headers.get("x-stainless-retry-count", "0")
                slot = await broker.park(
                    episode.id, dialect.name, parsed.request, raw, stream=parsed.stream, retry=retry not in ("", "0")
                )
            except TrajproxyError as e:
                return refusal(dialect, e)
            return ParkedReply(broker, dialect, parsed, slot, episode, settings.keepalive_s)

        return call

    async def models() -> Response:
        return Response(MODELS, media_type="application/json")

    anthropic = AnthropicDialect()

    async def count_tokens(request: Request) -> Response:
        """Anthropic's token counter: the same count trajproxy puts in replies' usage; nothing is parked."""
        try:
            await broker.authenticate(agent_key(request))
            _, body = await read_json(request, settings.max_body_bytes)
            parsed = anthropic.parse(body)
        except TrajproxyError as e:
            return refusal(anthropic, e)
        tokens = await asyncio.to_thread(broker.count_tokens, parsed.request)
        return Response(orjson.dumps({"input_tokens": tokens}), media_type="application/json")

    responses_dialect = ResponsesDialect()

    async def continue_response(episode: Episode, body: JsonObject, parsed: Call) -> Call:
        """With previous_response_id, the earlier turn of this episode that the call continues."""
        previous_id = responses_dialect.previous_turn_id(body)
        if previous_id is None:
            return parsed
        try:
            previous = await broker.turn(previous_id)
        except NotFound:
            previous = None
        if previous is None or previous.episode_id != episode.id:
            raise NotFound(f"previous response resp_{previous_id} is not a response of this episode")
        return responses_dialect.continue_from(parsed, previous)

    chat = endpoint(ChatDialect())
    messages = endpoint(anthropic)
    responses = endpoint(responses_dialect, continue_response)
    for prefix in ("", "/e/{key}"):
        router.add_api_route(f"{prefix}/v1/chat/completions", chat, methods=["POST"])
        router.add_api_route(f"{prefix}/v1/messages", messages, methods=["POST"])
        router.add_api_route(f"{prefix}/v1/responses", responses, methods=["POST"])
        router.add_api_route(f"{prefix}/v1/messages/count_tokens", count_tokens, methods=["POST"])
        router.add_api_route(f"{prefix}/v1/models", models, methods=["GET"])
    return router
