"""The app factory: builds the adapters once, wires them into the broker, and the broker into the route table
(`proxy.http.routes`), which names every route trajproxy serves, the door each passes and what serves it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from proxy import __version__
from proxy.adapters.litellm_upstream import LitellmUpstream
from proxy.adapters.prometheus_metrics import PrometheusMetrics
from proxy.adapters.served_upstream import ServedUpstream
from proxy.adapters.tiktoken_counter import TiktokenCounter
from proxy.core.broker import Broker
from proxy.core.context import Context
from proxy.core.errors import TrajproxyError
from proxy.core.keys import new_id
from proxy.core.local_queue import LocalQueue
from proxy.core.shared_queue import SharedQueue
from proxy.core.upstreams import Upstreams
from proxy.http.agent import AgentCalls
from proxy.http.docs import add_docs
from proxy.http.edge import error_body, invalid, redact, status_of
from proxy.http.health import Health
from proxy.http.metrics import add_metrics
from proxy.http.origins import LocalCallers
from proxy.http.queries import DeclaredQueries
from proxy.http.routes import Route, Router, framework_routes, route_table
from proxy.http.shutdown import Shutdown
from proxy.http.stream import TurnStream
from proxy.http.trainer import TrainerApi
from proxy.http.trainer_door import TrainerDoor
from proxy.http.ui import add_ui
from proxy.settings import Settings
from proxy.storage.postgres_queue import PostgresQueue
from proxy.storage.sql import SqlStore
from proxy.trainer_token import settle

log = logging.getLogger("trajproxy")


class Trajproxy(Router):
    """The whole ASGI app (its route table's router), with the broker it serves, the settings it was built with
    (its trainer token too) and the metrics it exposes (which a program serving it in-process also feeds:
    sandboxes started and failed). Its front calls `stopping()` as its shutdown begins."""

    def __init__(
        self,
        broker: Broker,
        settings: Settings,
        metrics: PrometheusMetrics,
        table: list[Route],
        api: FastAPI,
        shutdown: Shutdown,
    ) -> None:
        token = settings.trainer_token.get_secret_value() if settings.trainer_token else None
        callers = LocalCallers(settings.public_url)
        trainer_door = TrainerDoor(token, settings.max_body_bytes, DeclaredQueries(api.openapi), callers)
        super().__init__(table, trainer_door, api, settings.body_read_timeout_s, settings.body_timeout_s)
        self.broker = broker
        self.settings = settings
        self.metrics = metrics
        self._shutdown = shutdown

    def stopping(self) -> None:
        """The server is stopping: the trainer's long polls and streams end now (on the server's event loop)."""
        self._shutdown.begin()


def create_app(settings: Settings) -> Trajproxy:
    settings, _ = settle(settings)  # the trainer API is never open unless the settings opt out
    metrics = PrometheusMetrics()
    replica = new_id("rp") if settings.shared else None  # one of several replicas sharing a Postgres database
    store = SqlStore(settings.database_url, on_commit=metrics.committed, replica=replica)
    key = settings.policy_api_key.get_secret_value() if settings.policy_api_key else None
    served = ServedUpstream(api_key=key)
    context = Context.build(
        store=store,
        tokens=TiktokenCounter(),
        upstream=Upstreams({"model": LitellmUpstream(), "vllm": served, "sglang": served}),
        lease_s=settings.lease_s,
        turn_timeout_s=settings.turn_timeout_s,
        retry_grace_s=settings.retry_grace_s,
        restart_grace_s=settings.restart_grace_s,
        observer=metrics,
    )
    queue = (  # the one place that knows whether replicas share the database
        SharedQueue(context=context, database=PostgresQueue(store, dead_after_s=settings.replica_dead_s))
        if settings.shared
        else LocalQueue(context=context)
    )
    broker = Broker(context=context, queue=queue)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await store.open()
        try:
            await broker.start()  # the open turns a previous run left, for their agents' retries
            yield
        finally:
            await broker.drain()
            await broker.stop()
            await served.aclose()
            await store.close()

    api = FastAPI(
        title="trajproxy",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,  # served from the package below, not from a CDN
        openapi_url="/api/openapi.json",
        redoc_url=None,
    )
    shutdown = Shutdown()
    trainer = TrainerApi(broker, settings, api, shutdown)
    stream = TurnStream(broker, shutdown)
    table = route_table(AgentCalls(broker, settings), trainer, stream, Health(broker, replica), api)
    add_docs(api, "/api/openapi.json")
    api.include_router(framework_routes(table))
    add_metrics(api, metrics, broker, store)
    add_ui(api, broker, store, settings.trainer_token.get_secret_value() if settings.trainer_token else None)
    api.add_exception_handler(TrajproxyError, _domain_error)  # type: ignore[arg-type]
    api.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    api.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    return Trajproxy(broker, settings, metrics, table, api, shutdown)


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
