"""The route table names every route trajproxy serves, each with its door and its one handler: the sub-apps it
mounts (the page) and FastAPI's trainer routes are in it behind their doors, the routes every turn crosses (an
agent's call, the trainer's batch pull and reply) reach their plain handlers and nothing else serves them, and what
no route serves gets the router's own 404 or 405. What each route answers is proven over live servers by the tests
of each route."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.routing import BaseRoute, Mount
from starlette.routing import Route as StarletteRoute
from starlette.testclient import TestClient

from proxy.app import Trajproxy, create_app
from proxy.http.routes import ANY, Door, Route
from proxy.http.trainer import Framework
from proxy.http.ui import Page
from proxy.settings import Settings

TCP = ("127.0.0.1", 8000)
TOKEN = "t" * 40
HOT = (("GET", "/api/turns/next"), ("POST", "/api/turns/replies"))


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Trajproxy:
    folder: Path = tmp_path_factory.mktemp("table")
    return create_app(Settings(database_url=f"sqlite:///{folder}/t.db", trainer_token=TOKEN))


def request(app: Trajproxy, method: str, path: str, server: Any = TCP, kind: str = "http") -> Route:
    found = app.match({"type": kind, "method": method, "path": path, "server": server})
    assert found is not None, (method, path)
    return found[0]


def concrete(template: str) -> str:
    """A path the template matches: `x` for each segment parameter, `x/y` for each path parameter."""
    return re.sub(r"\{\w+\}", "x", re.sub(r"\{\w+:path\}", "x/y", template))


def flattened(routes: Sequence[BaseRoute]) -> Iterator[BaseRoute]:
    """The routes, those of included routers among them (FastAPI keeps an included router whole, as one entry)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from flattened(included.routes)
        else:
            yield route


def served_by(api: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every route a FastAPI app serves, a mount's as a path under it."""
    served: list[tuple[str, str]] = []
    for route in flattened(api.routes):
        if isinstance(route, Mount):
            served.append(("GET", route.path + "/x"))
        else:
            assert isinstance(route, StarletteRoute), route
            served += [(method, concrete(route.path)) for method in route.methods or ()]
    return served


def frameworks(app: Trajproxy) -> dict[Any, FastAPI]:
    """The FastAPI apps the table sends requests to, by the handler that does (the trainer API's `Framework`, the
    page's `Page`): each handler's app, built as its first request would build it."""
    handlers = (route.serve for route in app.table if isinstance(route.serve, Framework | Page))
    return {handler: handler.framework for handler in handlers}


def test_every_route_the_frameworks_serve_is_in_the_table_behind_its_door(app: Trajproxy) -> None:
    apps = frameworks(app)
    assert len(apps) == 2  # the trainer API's and the page's
    paths = {path for api in apps.values() for _, path in served_by(api)}
    assert {"/api/episodes", "/ui/login", "/ui/static/x"} <= paths
    assert not {"/metrics", "/health", "/api/docs", "/api/openapi.json"} & paths  # plain handlers, in the table
    for handler, api in apps.items():
        for method, path in served_by(api):
            route = request(app, method, path)
            assert route.serve is handler, f"{method} {path} is served by a framework the table does not send it to"
            assert route.door is (Door.TRAINER if path.startswith("/api/") else Door.OPEN), (method, path, route)
            # On the sandbox socket none of it is served: the socket's door answers
            on_socket = request(app, method, path, server=None)
            assert on_socket.door is Door.SOCKET and on_socket.path == ANY, (method, path)
    # Every route the table has FastAPI serve is registered there, at its path and methods
    registered = {pair for api in apps.values() for pair in served_by(api)}
    for route in app.table:
        if route.endpoint is not None:
            assert {(method, concrete(route.path)) for method in route.allowed} <= registered, route


def test_the_routes_every_turn_crosses_are_plain_handlers_and_only_theirs(app: Trajproxy) -> None:
    apps = frameworks(app)
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
                assert route.door is Door.AGENT and route.serve not in apps, (method, prefix + path)
    found = app.match({"type": "http", "method": "POST", "path": "/e/tpk-abc/v1beta/models/a/b:c", "server": TCP})
    assert found is not None and found[1] == {"model": "a/b", "method": "c", "key": "tpk-abc"}

    registered = {pair for api in apps.values() for pair in served_by(api)}
    for method, path in HOT:
        route = request(app, method, path)
        assert route.door is Door.TRAINER and route.serve not in apps and route.endpoint is None
        assert (method, path) not in registered  # one handler: no framework route stands behind it
    stream = request(app, "GET", "/api/turns/stream", kind="websocket")
    assert stream.door is Door.TRAINER and stream.serve not in apps
    assert app.match({"type": "websocket", "method": "GET", "path": "/v1/chat/completions", "server": TCP}) is None


def test_the_document_describes_the_plain_trainer_routes_from_the_models_the_table_names(app: Trajproxy) -> None:
    with TestClient(app) as client:
        document = client.get("/api/openapi.json").json()
    pull = document["paths"]["/api/turns/next"]["get"]
    assert [p["name"] for p in pull["parameters"]] == ["episode", "max", "wait", "lease"]
    assert pull["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/TurnBatch")
    reply = document["paths"]["/api/turns/replies"]["post"]
    assert [p["name"] for p in reply["parameters"]] == ["pull", "episode", "wait", "lease"]
    assert reply["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ReplyBatch")
    assert reply["operationId"] == "reply_many_api_turns_replies_post"


def test_what_no_route_serves_gets_the_routers_404_or_405(app: Trajproxy) -> None:
    bearer = {"authorization": f"Bearer {TOKEN}"}
    with TestClient(app) as client:
        assert client.get("/nowhere").status_code == 404
        assert client.get("/nowhere").json()["error"]["message"] == "no route GET /nowhere"
        refused = client.post("/metrics")
        assert refused.status_code == 405 and refused.headers["allow"] == "GET"
        assert client.post("/api/docs").status_code == 405  # open: no token asked for
        assert client.delete("/api/episodes").status_code == 401  # under /api the trainer's door comes first
        refused = client.delete("/api/episodes", headers=bearer)
        assert refused.status_code == 405 and refused.headers["allow"] == "GET, POST"
        assert client.get("/api/nothing", headers=bearer).status_code == 404
        assert client.post("/ui/nothing").status_code in (404, 405)  # the page's own sub-table answers
