"""The route table names every route trajproxy serves: each of FastAPI's is in it with the door it passes, and the
routes every turn crosses (an agent's call, the trainer's batch pull and reply) reach their plain handlers, never
the framework. What each route answers is proven over live servers by the tests of each route."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.routing import BaseRoute, Mount
from starlette.routing import Route as StarletteRoute

from proxy.app import Trajproxy, create_app
from proxy.http.routes import ANY, Door, Route
from proxy.settings import Settings

TCP = ("127.0.0.1", 8000)
OPEN_UNDER_API = {"/api/docs", "/api/openapi.json"}  # the schema and its page


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Trajproxy:
    folder: Path = tmp_path_factory.mktemp("table")
    return create_app(Settings(database_url=f"sqlite:///{folder}/t.db", trainer_token="t" * 40))


def request(app: Trajproxy, method: str, path: str, server: Any = TCP, kind: str = "http") -> Route:
    found = app.match({"type": kind, "method": method, "path": path, "server": server})
    assert found is not None, (method, path)
    return found[0]


def concrete(template: str) -> str:
    """A path the template matches: `x` for each segment parameter, `x/y` for each path parameter."""
    return re.sub(r"\{\w+\}", "x", re.sub(r"\{\w+:path\}", "x/y", template))


def flattened(routes: Sequence[BaseRoute]) -> Iterator[BaseRoute]:
    """The routes, those of included routers among them (FastAPI keeps an included router whole, as one entry; ours
    are included without a prefix, their routes' paths whole)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from flattened(included.routes)
        else:
            yield route


def framework_routes(api: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every route FastAPI serves, a mount's as a path under it."""
    served: list[tuple[str, str]] = []
    for route in flattened(api.routes):
        if isinstance(route, Mount):
            served.append(("GET", route.path + "/x"))
        else:
            assert isinstance(route, StarletteRoute), route
            served += [(method, concrete(route.path)) for method in route.methods or ()]
    return served


def test_every_route_fastapi_serves_is_in_the_table_behind_its_door(app: Trajproxy) -> None:
    api = next(route.serve for route in app.table if isinstance(route.serve, FastAPI))
    served = framework_routes(api)
    assert len(served) > 30 and {"/api/episodes", "/metrics", "/ui/login", "/health"} <= {p for _, p in served}
    for method, path in served:
        route = request(app, method, path)
        assert route.path != ANY, f"{method} {path} is served by FastAPI but not named in the route table"
        gated = path.startswith("/api/") and path not in OPEN_UNDER_API
        assert route.door is (Door.TRAINER if gated else Door.OPEN), (method, path, route)
        assert route.serve is api or route.endpoint is not None, (method, path)  # a plain twin hands on to it
        # On the sandbox socket none of it is served: the socket's door answers
        on_socket = request(app, method, path, server=None)
        assert on_socket.door is Door.SOCKET, (method, path)
        if path != "/health":
            assert on_socket.path == ANY, (method, path)
    # Every route the table has FastAPI serve for the schema is registered there, at its path and methods
    registered = set(served)
    for route in app.table:
        if route.endpoint is not None:
            assert {(method, concrete(route.path)) for method in route.allowed} <= registered, route


def test_the_routes_every_turn_crosses_are_plain_handlers(app: Trajproxy) -> None:
    api = next(route.serve for route in app.table if isinstance(route.serve, FastAPI))
    agent_calls = [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/responses"),
        ("POST", "/v1/messages/count_tokens"),
        ("GET", "/v1/models"),
        ("POST", "/v1beta/models/gemini-2.5-pro:streamGenerateContent"),
        ("POST", "/v1/models/gemini-2.5-pro:countTokens"),
    ]
    for method, path in agent_calls:
        for prefix in ("", "/e/tpk-abc"):
            for server in (TCP, None):  # agents call over TCP and through the sandbox socket alike
                route = request(app, method, prefix + path, server=server)
                assert route.door is Door.AGENT and route.serve is not api, (method, prefix + path)
    found = app.match({"type": "http", "method": "POST", "path": "/e/tpk-abc/v1beta/models/a/b:c", "server": TCP})
    assert found is not None and found[1] == {"model": "a/b", "method": "c", "key": "tpk-abc"}

    for method, path in (("GET", "/api/turns/next"), ("POST", "/api/turns/replies")):
        route = request(app, method, path)
        assert route.door is Door.TRAINER and route.serve is not api and route.endpoint is not None
    stream = request(app, "GET", "/api/turns/stream", kind="websocket")
    assert stream.door is Door.TRAINER and stream.serve is not api
    assert app.match({"type": "websocket", "method": "GET", "path": "/v1/chat/completions", "server": TCP}) is None
