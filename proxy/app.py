"""The app factory: builds the adapters once, wires them into the broker, and the broker into the route table
(`route_table`), which names every route trajproxy serves, the door each passes and its one handler: the agents'
routes, the trainer API (under /api), the page (a sub-table of its own under /ui), metrics, the OpenAPI document and
its docs page. `proxy.http.routes.Router` serves the table.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.routing import Router as Lifespan  # a table of no routes: the server's lifespan alone
from starlette.types import ASGIApp

from proxy import schema
from proxy.adapters.litellm_upstream import LitellmUpstream
from proxy.adapters.prometheus_metrics import PrometheusMetrics
from proxy.adapters.served_upstream import ServedUpstream
from proxy.adapters.tiktoken_counter import TiktokenCounter
from proxy.core.answers import LocalQueue
from proxy.core.broker import Broker
from proxy.core.context import Context
from proxy.core.shared_queue import SharedQueue
from proxy.core.upstreams import Upstreams
from proxy.core.values import new_id
from proxy.http.agent import AgentCalls, AgentHandler
from proxy.http.docs import OPENAPI, ApiDocs, framework_app
from proxy.http.edge import Shutdown, sandbox_health, sandbox_refusal
from proxy.http.health import Health, root
from proxy.http.metrics import Metrics
from proxy.http.origins import LocalCallers
from proxy.http.routes import ANY, WEBSOCKET, Door, NoRoute, Route, Router, mount
from proxy.http.stream import TurnStream
from proxy.http.trainer import Framework, TrainerApi, for_every_app
from proxy.http.turns import TurnRoutes
from proxy.http.ui import Page
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
        lifespan: ASGIApp,
        openapi: Callable[[], dict[str, Any]],
        shutdown: Shutdown,
    ) -> None:
        token = settings.trainer_token.get_secret_value() if settings.trainer_token else None
        super().__init__(
            table,
            lifespan,
            token,
            LocalCallers(settings.public_url),
            openapi,
            settings.max_body_bytes,
            settings.body_read_timeout_s,
            settings.body_timeout_s,
        )
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
    if settings.shared:  # the one place that knows whether replicas share the database
        shared = SharedQueue(context=context, database=PostgresQueue(store, dead_after_s=settings.replica_dead_s))
        broker = Broker(context=context, queue=shared, others=shared)
    else:
        broker = Broker(context=context, queue=LocalQueue(context=context))

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        await store.open()
        try:
            await broker.start()  # the open turns a previous run left, for their agents' retries
            yield
        finally:
            await broker.wind_down()
            await broker.stop()
            await served.aclose()
            await store.close()

    shutdown = Shutdown()
    token = settings.trainer_token.get_secret_value() if settings.trainer_token else None
    table: list[Route] = []
    docs = ApiDocs(lambda: table)
    table += route_table(
        agents=AgentCalls(broker, settings),
        turns=TurnRoutes(broker, settings.max_body_bytes, shutdown),
        # The trainer API's handlers but the batch pull and reply: the process's FastAPI app serves them
        api=Framework(TrainerApi(broker, settings, shutdown), lambda: framework_app(table)),
        stream=TurnStream(broker, shutdown),
        docs=docs,
        health=Health(broker, replica),
        metrics=Metrics(metrics, broker, store),
        page=Page(broker, store, token),
        no_route=NoRoute(table),
    )
    return Trajproxy(broker, settings, metrics, table, Lifespan(lifespan=lifespan), lambda: docs.document, shutdown)


def route_table(
    agents: AgentCalls,
    turns: TurnRoutes,
    api: ASGIApp,
    stream: TurnStream,
    docs: ApiDocs,
    health: Health,
    metrics: Metrics,
    page: ASGIApp,
    no_route: ASGIApp,
) -> list[Route]:
    """Every route trajproxy serves."""

    def agent(methods: str, path: str, handler: AgentHandler) -> Route:
        return Route(methods, path, Door.AGENT, handler, keyed=True, dialect=handler.dialect)

    def trainer_api(methods: str, path: str, method: Callable[..., Any], model: type, status: int = 200) -> Route:
        return Route(methods, path, Door.TRAINER, api, for_every_app(method), status, model)

    return [
        # Agents (OpenAI, Anthropic, Gemini), each also under /e/<key>
        agent("POST", "/v1/chat/completions", agents.chat),
        agent("POST", "/v1/messages", agents.messages),
        agent("POST", "/v1/responses", agents.responses),
        agent("POST", "/v1/messages/count_tokens", agents.count_tokens),
        agent("GET", "/v1/models", agents.models),
        agent("POST", "/v1beta/models/{model:path}:{method:path}", agents.gemini),
        agent("POST", "/v1/models/{model:path}:{method:path}", agents.gemini),
        # The trainer API, in its document's order: FastAPI serves it, but for the batch pull and reply (the
        # trainer's share of every turn), whose plain handlers validate their query and body models themselves
        trainer_api("POST", "/api/episodes", TrainerApi.create_episode, schema.EpisodeCreated, 201),
        trainer_api("POST", "/api/episodes/{episode_id}/fork", TrainerApi.fork, schema.Forks, 201),
        trainer_api("GET", "/api/episodes", TrainerApi.list_episodes, schema.EpisodeList),
        trainer_api("GET", "/api/episodes/{episode_id}", TrainerApi.get_episode, schema.Episode),
        trainer_api("POST", "/api/episodes/{episode_id}/finish", TrainerApi.finish_episode, schema.Episode),
        trainer_api("POST", "/api/episodes/{episode_id}/rewards", TrainerApi.add_reward, schema.Reward, 201),
        trainer_api("GET", "/api/episodes/{episode_id}/trajectory", TrainerApi.trajectory, schema.Trajectory),
        trainer_api("POST", "/api/episodes/{episode_id}/reset", TrainerApi.reset, schema.TimeStep),
        trainer_api("POST", "/api/episodes/{episode_id}/step", TrainerApi.step, schema.TimeStep),
        Route(
            "GET", "/api/turns/next", Door.TRAINER, turns.next_turns, model=schema.TurnBatch, query=schema.TurnsQuery
        ),
        trainer_api("GET", "/api/turns/{turn_id}", TrainerApi.get_turn, schema.Turn),
        trainer_api("POST", "/api/turns/{turn_id}/reply", TrainerApi.reply, schema.Turn),
        trainer_api("POST", "/api/pause", TrainerApi.pause, schema.PauseState),
        trainer_api("POST", "/api/resume", TrainerApi.resume, schema.PauseState),
        Route(
            "POST",
            "/api/turns/replies",
            Door.TRAINER,
            turns.reply_many,
            model=schema.ReplyResults,
            query=schema.RepliesQuery,
            body=schema.ReplyBatch,
        ),
        trainer_api("POST", "/api/turns/{turn_id}/forward", TrainerApi.forward, schema.Turn),
        Route(WEBSOCKET, "/api/turns/stream", Door.TRAINER, stream),  # leased turns pushed, replies sent back
        # The document and its page: no data, no token
        Route("GET", OPENAPI, Door.OPEN, docs.openapi),
        Route("GET", "/api/docs", Door.OPEN, docs.page),
        Route(ANY, OPENAPI, Door.OPEN, no_route),
        Route(ANY, "/api/docs", Door.OPEN, no_route),
        *mount("/docs-assets", docs.assets, Door.OPEN),  # the docs page's scripts and styles
        # The rest under /api: the trainer's door, then the router's 404 or 405
        Route(ANY, "/api/{path:path}", Door.TRAINER, no_route),
        # Open on TCP (and /health, bare, on the sandbox socket)
        Route("GET HEAD", "/health", Door.SOCKET, sandbox_health),
        Route("GET", "/health", Door.OPEN, health),
        Route("GET HEAD", "/", Door.OPEN, root),
        Route("GET", "/metrics", Door.OPEN, metrics),
        *mount("/ui", page, Door.OPEN),  # the web page, which asks for its own login
        # Anything else: on the sandbox socket a 403 (a 404 under /e/<key>), on TCP a 404 (a 405 for a known path)
        Route(ANY, ANY, Door.SOCKET, sandbox_refusal),
        Route(ANY, ANY, Door.OPEN, no_route),
    ]
