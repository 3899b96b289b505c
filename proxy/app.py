"""The app factory: builds the adapters once, wires them into the broker and the routes.

An agent's call goes straight to its handler (`AgentRoutes`). The trainer's WebSocket stream meets TrainerGate
(the token) and TurnStream; any other WebSocket handshake is refused with 426. On the sandboxes' Unix socket,
nothing else is served (`sandbox_door`). Anything else meets, in order:
TrainerGate (the trainer API's token, query names and body limit), FastLane (the trainer's batch pull and reply,
as plain ASGI), and FastAPI (the rest of the trainer API, its schema and docs, and 404s).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy import __version__
from proxy.adapters.litellm_upstream import LitellmUpstream
from proxy.adapters.prometheus_metrics import PrometheusMetrics
from proxy.adapters.served_upstream import ServedUpstream
from proxy.adapters.tiktoken_counter import TiktokenCounter
from proxy.core.broker import Broker
from proxy.core.errors import TrajproxyError
from proxy.core.keys import new_id
from proxy.core.upstreams import Upstreams
from proxy.http.agent import AgentRoutes
from proxy.http.docs import add_docs
from proxy.http.edge import asks_upgrade, error_body, invalid, redact, refuse_upgrade, status_of
from proxy.http.fast import FastLane
from proxy.http.gate import TrainerGate
from proxy.http.metrics import add_metrics
from proxy.http.queries import DeclaredQueries
from proxy.http.sandbox_door import from_sandbox, sandbox_door
from proxy.http.stalls import timed_body
from proxy.http.stream import PATH as STREAM_PATH
from proxy.http.stream import TurnStream
from proxy.http.trainer import trainer_routes
from proxy.http.ui import add_ui
from proxy.settings import Settings
from proxy.storage.postgres_queue import PostgresQueue
from proxy.storage.sql import SqlStore
from proxy.trainer_token import settle

log = logging.getLogger("trajproxy")


class Trajproxy:
    """The whole ASGI app, with the broker it serves, the settings it was built with (its trainer token too) and
    the metrics it exposes (which a program serving it in-process also feeds: sandboxes started and failed)."""

    def __init__(self, broker: Broker, api: FastAPI, settings: Settings, metrics: PrometheusMetrics) -> None:
        self.broker = broker
        self.settings = settings
        self.metrics = metrics
        self._agents = AgentRoutes(broker, settings)
        token = settings.trainer_token.get_secret_value() if settings.trainer_token else None
        queries = DeclaredQueries(api.openapi)
        self._rest = TrainerGate(
            FastLane(api, broker, settings), token=token, max_body_bytes=settings.max_body_bytes, queries=queries
        )
        self._stream = TrainerGate(TurnStream(broker), token=token, max_body_bytes=0, queries=queries)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            receive, send = timed_body(receive, send, self.settings.body_read_timeout_s)
        if scope["type"] == "websocket" and scope["path"] == STREAM_PATH:
            await self._stream(scope, receive, send)
        elif scope["type"] == "websocket" or (scope["type"] == "http" and asks_upgrade(scope)):
            await refuse_upgrade(scope, send)
        elif scope["type"] == "http" and (agent_call := self._agents.route(scope)) is not None:
            await agent_call(scope, receive, send)
        elif scope["type"] == "http" and from_sandbox(scope):
            await sandbox_door(scope, send)
        else:
            await self._rest(scope, receive, send)


def create_app(settings: Settings) -> Trajproxy:
    settings, _ = settle(settings)  # the trainer API is never open unless the settings opt out
    metrics = PrometheusMetrics()
    replica = new_id("rp") if settings.shared else None  # one of several replicas sharing a Postgres database
    store = SqlStore(settings.database_url, on_commit=metrics.committed, replica=replica)
    shared = PostgresQueue(store, dead_after_s=settings.replica_dead_s) if settings.shared else None
    tokens = TiktokenCounter()
    key = settings.policy_api_key.get_secret_value() if settings.policy_api_key else None
    served = ServedUpstream(api_key=key)
    broker = Broker(
        store,
        tokens,
        Upstreams({"model": LitellmUpstream(), "vllm": served, "sglang": served}),
        turn_timeout_s=settings.turn_timeout_s,
        lease_s=settings.lease_s,
        retry_grace_s=settings.retry_grace_s,
        restart_grace_s=settings.restart_grace_s,
        observer=metrics,
        shared=shared,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await store.open()
        try:
            await broker.recover()  # the open turns a previous run left, for their agents' retries
            yield
        finally:
            await broker.drain()
            await broker.stop()
            await served.aclose()
            await store.close()

    app = FastAPI(
        title="trajproxy",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,  # served from the package below, not from a CDN
        openapi_url="/api/openapi.json",
        redoc_url=None,
    )
    add_docs(app, "/api/openapi.json")
    app.include_router(trainer_routes(broker, settings))
    add_metrics(app, metrics, broker, store)
    add_ui(app, broker, store, settings.trainer_token.get_secret_value() if settings.trainer_token else None)

    @app.get("/health", include_in_schema=False)
    async def health() -> Response:
        status = {
            "status": "ok",
            "open_turns": broker.open_turns,
            "ready_turns": broker.ready_turns,
            "waiting_pollers": broker.waiting_pollers,
            "paused": broker.weights.paused,
            "policy_version": broker.weights.policy_version,
        }
        if replica is not None:
            status["replica"] = replica
        return Response(orjson.dumps(status), media_type="application/json")

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> Response:
        return Response(orjson.dumps({"name": "trajproxy", "version": __version__}), media_type="application/json")

    app.add_exception_handler(TrajproxyError, _domain_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    return Trajproxy(broker, app, settings, metrics)


def error_response(status: int, kind: str, message: str) -> Response:
    return Response(error_body(kind, message), status, media_type="application/json")


async def _domain_error(_request: Request, error: TrajproxyError) -> Response:
    return error_response(status_of(error), error.kind, error.message)


async def _invalid(_request: Request, error: RequestValidationError) -> Response:
    problems = error.errors()
    if any(problem.get("type") == "json_invalid" for problem in problems):
        return error_response(400, "invalid_request_error", "request body is not valid JSON")
    return error_response(422, "invalid_request_error", invalid(problems))


async def _http_error(request: Request, error: HTTPException) -> Response:
    if error.status_code == 404:
        message = f"no route {request.method} {redact(request.url.path)}"
        return error_response(404, "not_found_error", message)
    if error.status_code == 405:
        message = f"{request.method} is not allowed on {redact(request.url.path)}"
        return error_response(405, "invalid_request_error", message)
    return error_response(error.status_code, "error", str(error.detail))
