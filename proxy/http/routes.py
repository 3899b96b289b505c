"""The route table: every route trajproxy serves, with the door it passes and what serves it, in one list
(`route_table`); and `Router`, the ASGI app that matches each request against it once and sends it on.

Agent routes (every turn crosses them) and the trainer's batch pull and reply are plain ASGI handlers: no framework
layer between the server and the broker. The rest of the trainer API is served by FastAPI (`api`), which validates
what it takes and builds the OpenAPI schema from the routes here that name an `endpoint` (`framework_routes`); the
docs, `/metrics` and the page under `/ui` are FastAPI's too (`proxy.http.docs`, `proxy.http.metrics`,
`proxy.http.ui`). The doors:

- AGENT: an episode key (in the path's `/e/<key>` prefix, a header, or Gemini's `key` query parameter), checked by
  the handler, which answers in its dialect's shape; on TCP and on the sandbox socket.
- TRAINER: the trainer token, the query's declared names, the body limit and its nesting (`TrainerDoor`), before
  the handler reads anything or waits; TCP only.
- OPEN: nothing to show (the schema, the docs, metrics, the page, which checks its own login); TCP only. With no
  trainer token, only requests to a local host (`TrainerDoor.admit_open`), as on the trainer's door.
- SOCKET: the sandbox socket only.

Paths are exact or Starlette templates (`{name}`: one segment, `{name:path}`: the rest); an exact path is tried
before the templates, the templates in the table's order, and the first route whose path, method and door fit the
request serves it. A WebSocket handshake is served only by a WEBSOCKET route (any other is refused with 426, as is
an HTTP request asking to upgrade); an agent route's path with another method is a 405 in the agent's dialect.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy import schema
from proxy.dialects.dialect import Dialect
from proxy.http.agent import AgentCalls, AgentHandler, not_allowed
from proxy.http.edge import asks_upgrade, refuse_upgrade
from proxy.http.health import Health, root
from proxy.http.sandbox_door import from_sandbox, sandbox_door, sandbox_health
from proxy.http.stalls import timed_body
from proxy.http.stream import TurnStream
from proxy.http.trainer import TrainerApi
from proxy.http.trainer_door import TrainerDoor

WEBSOCKET = "WEBSOCKET"  # a route's method for a WebSocket handshake
ANY = "*"  # as a method: every HTTP method (the framework says which it allows); as a path: every path


class Door(enum.Enum):
    AGENT = "agent key"
    TRAINER = "trainer token"
    OPEN = "open"
    SOCKET = "sandbox socket"


@dataclass(frozen=True)
class Route:
    methods: str  # space-separated, or ANY, or WEBSOCKET
    path: str
    door: Door
    serve: ASGIApp  # a plain handler, or `api` (FastAPI) for the framework's routes
    endpoint: Callable[..., Any] | None = None  # FastAPI's handler: registered with the framework, in the schema
    status: int = 200  # its status and response model, for the schema
    model: type | None = None
    in_schema: bool = True
    keyed: bool = False  # also under /e/<key>: the episode key in the path
    dialect: Dialect | None = None  # an agent route's: the shape of its 405
    allowed: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed", frozenset(self.methods.split()))


def route_table(
    agents: AgentCalls, trainer: TrainerApi, stream: TurnStream, health: Health, api: ASGIApp
) -> list[Route]:
    """Every route trajproxy serves."""

    def agent(methods: str, path: str, handler: AgentHandler) -> Route:
        return Route(methods, path, Door.AGENT, handler, keyed=True, dialect=handler.dialect)

    def trainer_api(methods: str, path: str, endpoint: Callable[..., Any], model: type, status: int = 200) -> Route:
        return Route(methods, path, Door.TRAINER, api, endpoint, status, model)

    return [
        # Agents (OpenAI, Anthropic, Gemini), each also under /e/<key>: plain ASGI
        agent("POST", "/v1/chat/completions", agents.chat),
        agent("POST", "/v1/messages", agents.messages),
        agent("POST", "/v1/responses", agents.responses),
        agent("POST", "/v1/messages/count_tokens", agents.count_tokens),
        agent("GET", "/v1/models", agents.models),
        agent("POST", "/v1beta/models/{model:path}:{method:path}", agents.gemini),
        agent("POST", "/v1/models/{model:path}:{method:path}", agents.gemini),
        # The trainer API, in its schema's order: FastAPI serves it, but for the batch pull and reply (the trainer's
        # share of every turn), served plain when their input is well-formed, and by FastAPI when it is not
        trainer_api("POST", "/api/episodes", trainer.create_episode, schema.EpisodeCreated, 201),
        trainer_api("POST", "/api/episodes/{episode_id}/fork", trainer.fork, schema.Forks, 201),
        trainer_api("GET", "/api/episodes", trainer.list_episodes, schema.EpisodeList),
        trainer_api("GET", "/api/episodes/{episode_id}", trainer.get_episode, schema.Episode),
        trainer_api("POST", "/api/episodes/{episode_id}/finish", trainer.finish_episode, schema.Episode),
        trainer_api("POST", "/api/episodes/{episode_id}/rewards", trainer.add_reward, schema.Reward, 201),
        trainer_api("GET", "/api/episodes/{episode_id}/trajectory", trainer.trajectory, schema.Trajectory),
        trainer_api("POST", "/api/episodes/{episode_id}/reset", trainer.reset, schema.TimeStep),
        trainer_api("POST", "/api/episodes/{episode_id}/step", trainer.step, schema.TimeStep),
        Route("GET", "/api/turns/next", Door.TRAINER, trainer.batch_pull, trainer.next_turns, 200, schema.TurnBatch),
        trainer_api("GET", "/api/turns/{turn_id}", trainer.get_turn, schema.Turn),
        trainer_api("POST", "/api/turns/{turn_id}/reply", trainer.reply, schema.Turn),
        trainer_api("POST", "/api/pause", trainer.pause, schema.PauseState),
        trainer_api("POST", "/api/resume", trainer.resume, schema.PauseState),
        Route(
            "POST",
            "/api/turns/replies",
            Door.TRAINER,
            trainer.batch_reply,
            trainer.reply_many,
            model=schema.ReplyResults,
        ),
        trainer_api("POST", "/api/turns/{turn_id}/forward", trainer.forward, schema.Turn),
        Route(WEBSOCKET, "/api/turns/stream", Door.TRAINER, stream),  # leased turns pushed, replies sent back
        Route(ANY, "/api/docs", Door.OPEN, api),  # the schema and its page: no data, no token (FastAPI's 405s)
        Route(ANY, "/api/openapi.json", Door.OPEN, api),
        Route(ANY, "/api/{path:path}", Door.TRAINER, api),  # the rest under /api: the door, then FastAPI's 404/405
        # Open on TCP (and /health, bare, on the sandbox socket)
        Route("GET HEAD", "/health", Door.SOCKET, sandbox_health),  # on the sandbox socket, bare
        Route("GET", "/health", Door.OPEN, api, health.health, in_schema=False),
        Route("GET HEAD", "/", Door.OPEN, api, root, in_schema=False),
        Route("GET", "/metrics", Door.OPEN, api),
        Route(ANY, "/docs-assets/{path:path}", Door.OPEN, api),  # the docs page's scripts and styles
        Route(ANY, "/ui", Door.OPEN, api),  # the web page, which asks for its own login
        Route(ANY, "/ui/{path:path}", Door.OPEN, api),
        # Anything else: on the sandbox socket a 403 (a 404 under /e/<key>), on TCP FastAPI's 404 or 405
        Route(ANY, ANY, Door.SOCKET, sandbox_door),
        Route(ANY, ANY, Door.OPEN, api),
    ]


def framework_routes(table: Sequence[Route]) -> APIRouter:
    """FastAPI's routes: the table's that name an endpoint, in the table's order (the schema's)."""
    failed = {"model": schema.ApiError, "description": "the database or a model answering for the trainer failed"}
    refused = {"model": schema.ApiError, "description": "refused; 422: the query or body does not fit this schema"}
    router = APIRouter(tags=["trainer"], responses={"4XX": refused, "5XX": failed})
    for route in table:
        if route.endpoint is not None:
            router.add_api_route(
                route.path,
                route.endpoint,
                methods=sorted(route.allowed),
                status_code=route.status,
                response_model=route.model,
                include_in_schema=route.in_schema,
            )
    return router


def template(path: str) -> re.Pattern[str]:
    """A path template as a regex: `{name}` one segment, `{name:path}` any characters; ANY, any path."""
    if path == ANY:
        return re.compile(".*", re.DOTALL)
    parts = re.split(r"\{(\w+)(:path)?\}", path)
    pattern = re.escape(parts[0])
    for name, convertor, literal in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        pattern += f"(?P<{name}>{'.*' if convertor else '[^/]+'}){re.escape(literal)}"
    return re.compile(pattern, re.DOTALL)


class Router:
    """The whole ASGI app: a request matched once against the table, through its route's door to its handler.
    What is not a request (the server's lifespan: the store opens and closes) goes to FastAPI."""

    def __init__(
        self,
        table: Sequence[Route],
        trainer_door: TrainerDoor,
        api: ASGIApp,
        body_read_timeout_s: float,
        body_timeout_s: float,
    ) -> None:
        self.table = tuple(table)
        self._trainer_door = trainer_door
        self._api = api
        self._body_read_timeout_s = body_read_timeout_s
        self._body_timeout_s = body_timeout_s
        self._exact: dict[str, list[Route]] = {}
        self._templates: list[tuple[re.Pattern[str], Route]] = []
        for route in table:
            if "{" in route.path or route.path == ANY:
                self._templates.append((template(route.path), route))
            else:
                self._exact.setdefault(route.path, []).append(route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            receive, send = timed_body(receive, send, self._body_read_timeout_s, self._body_timeout_s)
            if asks_upgrade(scope):
                await refuse_upgrade(scope, send)
                return
        elif scope["type"] != "websocket":
            await self._api(scope, receive, send)
            return
        found = self.match(scope)
        if found is None:  # a WebSocket handshake on a path that takes none
            await refuse_upgrade(scope, send)
            return
        route, params = found
        if route.door is Door.AGENT:
            if scope["method"] not in route.allowed:
                assert route.dialect is not None
                await not_allowed(route.dialect, route.methods, scope, send)
                return
            scope["path_params"] = params
        elif route.door is Door.TRAINER:
            if scope["type"] == "websocket":
                if not await self._trainer_door.admit_handshake(scope, send):
                    return
            elif (admitted := await self._trainer_door.admit(scope, receive, send)) is None:
                return
            else:
                receive = admitted
        elif route.door is Door.OPEN and not await self._trainer_door.admit_open(scope, receive, send):
            return
        await route.serve(scope, receive, send)

    def match(self, scope: Scope) -> tuple[Route, dict[str, str]] | None:
        """The route that serves the request, and its path's parameters (the key of `/e/<key>` as `key`); None for
        a WebSocket handshake on a path that takes none."""
        path: str = scope["path"]
        if path.startswith("/e/"):  # an agent route with the episode key in the path
            key, _, rest = path[3:].partition("/")
            found = self._find(scope, "/" + rest, keyed=True)
            if found is not None:
                found[1]["key"] = key
                return found
        return self._find(scope, path, keyed=False)

    def _find(self, scope: Scope, path: str, keyed: bool) -> tuple[Route, dict[str, str]] | None:
        for route in self._exact.get(path, ()):
            if (route.keyed or not keyed) and self._fits(route, scope):
                return route, {}
        for pattern, route in self._templates:
            if (route.keyed or not keyed) and (matched := pattern.fullmatch(path)) and self._fits(route, scope):
                return route, matched.groupdict()
        return None

    @staticmethod
    def _fits(route: Route, scope: Scope) -> bool:
        """Whether the route takes the request's method (any, for an agent route: its 405 is its own) and its
        door is on the request's side: TCP, or the sandbox socket."""
        if scope["type"] == "websocket":  # the trainer's door refuses it on the socket, with a reason
            return route.methods == WEBSOCKET
        if route.door is Door.AGENT:
            return True
        if route.methods != ANY and scope["method"] not in route.allowed:
            return False
        return from_sandbox(scope) is (route.door is Door.SOCKET)
