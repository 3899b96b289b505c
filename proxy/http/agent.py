"""The agent-facing routes: what unmodified agents call, under /v1 and /e/<key>/v1."""

from __future__ import annotations

import asyncio

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from proxy.core.broker import Broker
from proxy.core.errors import TrajproxyError
from proxy.dialects.anthropic import AnthropicDialect
from proxy.dialects.chat import ChatDialect
from proxy.dialects.dialect import Dialect
from proxy.http.edge import agent_key, read_json, status_of
from proxy.http.parked import ParkedReply
from proxy.settings import Settings

MODELS = b'{"object":"list","data":[{"id":"trajproxy","object":"model","created":0,"owned_by":"trajproxy"}]}'


def agent_routes(broker: Broker, settings: Settings) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    def endpoint(dialect: Dialect):  # type: ignore[no-untyped-def]
        async def call(request: Request) -> Response:
            try:
                episode = await broker.authenticate(agent_key(request))
                raw, body = await read_json(request, settings.max_body_bytes)
                parsed = dialect.parse(body)
                slot = await broker.park(episode.id, dialect.name, parsed.request, raw, stream=parsed.stream)
            except TrajproxyError as e:
                status = status_of(e)
                error = dialect.error_body(status, e.kind, e.message)
                return Response(error, status, headers={"x-should-retry": "false"}, media_type="application/json")
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
            status = status_of(e)
            return Response(anthropic.error_body(status, e.kind, e.message), status, media_type="application/json")
        tokens = await asyncio.to_thread(broker.count_tokens, parsed.request)
        return Response(orjson.dumps({"input_tokens": tokens}), media_type="application/json")

    chat = endpoint(ChatDialect())
    messages = endpoint(anthropic)
    for prefix in ("", "/e/{key}"):
        router.add_api_route(f"{prefix}/v1/chat/completions", chat, methods=["POST"])
        router.add_api_route(f"{prefix}/v1/messages", messages, methods=["POST"])
        router.add_api_route(f"{prefix}/v1/messages/count_tokens", count_tokens, methods=["POST"])
        router.add_api_route(f"{prefix}/v1/models", models, methods=["GET"])
    return router
