"""What a route is (`Route`: its methods, path, door and handler), and `Router`, the ASGI app that matches each
request against the route table (`proxy.app.route_table`) once and sends it through its door to its handler.

Paths are exact or Starlette templates (`{name}`: one segment, `{name:path}`: the rest); an exact path is tried
before the templates, the templates in the table's order, and the first route whose path, method and door fit the
request serves it. A mounted sub-table (`mount`: the page) is a route for a prefix whose handler routes the rest. A
WebSocket handshake is served only by a WEBSOCKET route (any other is refused with 426, as is an HTTP request asking
to upgrade); an agent route's path with another method is a 405 in the agent's dialect, any other route's a 405 from
`no_route`, which answers 404 where no route has the path.

The doors, checked before the handler reads anything or waits:

- AGENT: an episode key (in the path's `/e/<key>` prefix, a header, or Gemini's `key` query parameter), checked by
  the handler, which answers in its dialect's shape; on TCP and on the sandbox socket.
- TRAINER: the trainer token (or, with none, that no web page sent the request: `proxy.http.origins`), the query's
  names as the OpenAPI document declares them, the body's size, type (JSON) and nesting; TCP only.
- OPEN: nothing to show (the document, the docs, metrics, the page, which checks its own login); TCP only. With no
  trainer token, only requests to a local host, as on the trainer's door.
- SOCKET: the sandbox socket only.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any
from urllib.parse import parse_qsl

from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.core.errors import BadRequest, Forbidden, TrajproxyError, Unauthorized
from proxy.core.values import same_secret
from proxy.dialects.dialect import Dialect
from proxy.http.edge import (
    DROPPED_BYTES,
    JSON,
    TOO_DEEP,
    asks_upgrade,
    declared_length,
    deny,
    drop_body,
    error_body,
    from_sandbox,
    parse_bearer,
    read_body,
    redact,
    refuse_upgrade,
    replay,
    respond,
    status_of,
    timed_body,
    too_deep,
)
from proxy.http.origins import LocalCallers

WEBSOCKET = "WEBSOCKET"  # a route's method for a WebSocket handshake
ANY = "*"  # as a method: every HTTP method (its handler says which it allows); as a path: every path


class Door(enum.Enum):
    AGENT = "agent key"
    TRAINER = "trainer token"
    OPEN = "open"
    SOCKET = "sandbox socket"


@dataclass(frozen=True)
class Route:
    """A route. One handler serves it (`serve`): a plain ASGI handler, or FastAPI's app for the trainer API's
    `endpoint`s. What the OpenAPI document says of it: a FastAPI `endpoint`'s signature, or a plain handler's `query`
    and `body` models; its `status` and response `model`."""

    methods: str  # space-separated, or ANY, or WEBSOCKET
    path: str
    door: Door
    serve: ASGIApp
    endpoint: Callable[..., Any] | None = None
    status: int = 200
    model: type | None = None
    query: type[BaseModel] | None = None
    body: type[BaseModel] | None = None
    keyed: bool = False  # also under /e/<key>: the episode key in the path
    dialect: Dialect | None = None  # an agent route's: the shape of its 405
    allowed: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed", frozenset(self.methods.split()))

    @property
    def documented(self) -> bool:
        return self.model is not None


def mount(prefix: str, app: ASGIApp, door: Door) -> list[Route]:
    """A sub-table under `prefix`: every method, the prefix and every path below it, routed by `app` (which sees the
    whole path)."""
    return [Route(ANY, prefix, door, app), Route(ANY, prefix + "/{path:path}", door, app)]


def template(path: str) -> re.Pattern[str]:
    """A path template as a regex: `{name}` one segment, `{name:path}` any characters; ANY, any path."""
    if path == ANY:
        return re.compile(".*", re.DOTALL)
    parts = re.split(r"\{(\w+)(:path)?\}", path)
    pattern = re.escape(parts[0])
    for name, convertor, literal in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        pattern += f"(?P<{name}>{'.*' if convertor else '[^/]+'}){re.escape(literal)}"
    return re.compile(pattern, re.DOTALL)


class NoRoute:
    """The handler of what no route serves: 404 where no route has the path, 405 where routes have it but take other
    methods (on the request's side: TCP, or the sandbox socket)."""

    def __init__(self, table: Sequence[Route]) -> None:
        self._table = table  # the table it ends, read when a request comes

    def allowed(self, scope: Scope) -> list[str]:
        """The methods the routes of the request's path take on its side (none: no route has the path)."""
        path, on_socket = scope["path"], from_sandbox(scope)
        methods: set[str] = set()
        for route in self._table:
            if (
                route.methods in (ANY, WEBSOCKET)
                or route.door is Door.AGENT
                or on_socket is not (route.door is Door.SOCKET)
            ):
                continue
            if route.path == path or ("{" in route.path and template(route.path).fullmatch(path)):
                methods |= route.allowed
        return sorted(methods)

    async def __call__(self, scope: Scope, _receive: Receive, send: Send) -> None:
        method, shown = scope["method"], redact(scope["path"])
        if allowed := self.allowed(scope):
            body = error_body("invalid_request_error", f"{method} is not allowed on {shown}")
            await respond(send, 405, body, [*JSON, (b"allow", ", ".join(allowed).encode())])
        else:
            await respond(send, 404, error_body("not_found_error", f"no route {method} {shown}"))


class Router:
    """The whole ASGI app: a request matched once against the table, through its route's door to its handler.
    What is not a request (the server's lifespan: the store opens and closes) goes to `lifespan`."""

    def __init__(
        self,
        table: Sequence[Route],
        lifespan: ASGIApp,
        token: str | None,
        callers: LocalCallers,
        openapi: Callable[[], dict[str, Any]],
        max_body_bytes: int,
        body_read_timeout_s: float,
        body_timeout_s: float,
    ) -> None:
        self.table = tuple(table)
        self._lifespan = lifespan
        self._token = token
        self._callers = callers
        self._openapi = openapi  # built on the first request with a query: the document takes ~0.1 s to build
        self._max_body_bytes = max_body_bytes
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
            await self._lifespan(scope, receive, send)
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
                if not await self._admit_handshake(scope, send):
                    return
            elif (admitted := await self._admit(scope, receive, send)) is None:
                return
            else:
                receive = admitted
        elif route.door is Door.OPEN and not await self._admit_open(scope, receive, send):
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

    # The trainer's door

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """Check an HTTP request at the trainer's door and read its body: what its route reads the body from, or
        None once the request has been refused."""
        try:
            self._check_door(scope)
            unknown = self._unknown_query(scope["method"], scope["path"], scope["query_string"])
        except TrajproxyError as e:
            await self._drain(scope, receive)
            await _refuse(send, status_of(e), e.kind, e.message)
            return None
        if unknown is not None:
            await self._drain(scope, receive)
            await _refuse(send, 422, BadRequest.kind, unknown)  # the status of any other query a route cannot take
            return None
        try:
            body = await read_body(scope, receive, self._max_body_bytes)
            if body and not declared_json(scope):
                await _refuse(send, 415, BadRequest.kind, NOT_JSON)
                return None
            if too_deep(body):
                raise BadRequest(TOO_DEEP)
        except TrajproxyError as e:
            await _refuse(send, status_of(e), e.kind, e.message)
            return None
        return replay(body, receive)

    async def _admit_open(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Check a request to an open route (the page, the docs, metrics): with no token, the page is as open as the
        API, so it too answers only requests to a local host. False once it has been refused."""
        if self._token is not None:
            return True
        try:
            self._callers.check(scope["headers"], api=False)
        except TrajproxyError as e:
            await self._drain(scope, receive)
            await _refuse(send, status_of(e), e.kind, e.message)
            return False
        return True

    async def _admit_handshake(self, scope: Scope, send: Send) -> bool:
        """Check a WebSocket handshake (the trainer's stream) before it is accepted; its query is the stream's own
        to check. False once it has been refused."""
        try:
            self._check_door(scope)
        except TrajproxyError as e:
            await deny(scope, send, status_of(e), error_body(e.kind, e.message))
            return False
        return True

    async def _drain(self, scope: Scope, receive: Receive) -> None:
        """Read and drop the body of a request refused before it was read (up to the body limit, and as long as it
        does not stall): a connection closed with a body still arriving is reset, and the reset can reach the client
        before it has read the refusal. A body declared larger than that is not read: its connection is closed."""
        most = self._max_body_bytes + DROPPED_BYTES
        if (declared_length(scope) or 0) <= most:
            await drop_body(receive, most)

    def _check_door(self, scope: Scope) -> None:
        if from_sandbox(scope):  # the sandboxes' door, agents only
            raise Forbidden("the trainer API is not served on the sandbox socket; use trajproxy's TCP address")
        self._check_token(scope)

    def _check_token(self, scope: Scope) -> None:
        if self._token is None:  # nothing to show: a program on this machine may call, a web page may not
            self._callers.check(scope["headers"], api=True)
            return
        given = parse_bearer(dict(scope["headers"]).get(b"authorization", b"").decode("latin-1"))
        if given is None or not same_secret(given, self._token):
            raise Unauthorized("the trainer API needs 'Authorization: Bearer <TRAJPROXY_TRAINER_TOKEN>'")

    def _unknown_query(self, method: str, path: str, query_string: bytes) -> str | None:
        """A one-line refusal naming the query parameters the operation does not declare in the OpenAPI document
        (a typo such as `?wiat=5` is refused at once, not ignored while a long poll waits out its default), or None
        (none, or no such operation: its 404 or 405 is the router's to give)."""
        if not query_string:
            return None
        operation = self._operation(method, path)
        if operation is None:
            return None
        label, declared = operation
        names = dict.fromkeys(name for name, _ in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True))
        unknown = [name for name in names if name not in declared]
        if not unknown:
            return None
        quoted = ", ".join(repr(name[:40]) for name in unknown[:_NAMED])
        more = f" and {len(unknown) - _NAMED} more" if len(unknown) > _NAMED else ""
        takes = f"takes only {', '.join(declared)}" if declared else "takes no query parameters"
        plural = "s" if len(unknown) > 1 else ""
        return f"unknown query parameter{plural} {quoted}{more}: {label} {takes}"

    def _operation(self, method: str, path: str) -> Operation | None:
        static, templated = self._operations
        found = static.get((method, path))
        if found is not None:
            return found
        for route_method, pattern, operation in templated:
            if route_method == method and pattern.fullmatch(path):
                return operation
        return None

    @cached_property
    def _operations(self) -> tuple[dict[tuple[str, str], Operation], list[tuple[str, re.Pattern[str], Operation]]]:
        """The document's operations: static paths by (method, path); templated ones in the document's order."""
        static: dict[tuple[str, str], Operation] = {}
        templated: list[tuple[str, re.Pattern[str], Operation]] = []
        for path, operations in self._openapi()["paths"].items():
            for method, operation in operations.items():
                declared = tuple(p["name"] for p in operation.get("parameters", ()) if p["in"] == "query")
                entry = (f"{method.upper()} {path}", declared)
                if "{" not in path:
                    static[(method.upper(), path)] = entry
                else:
                    templated.append((method.upper(), template(path), entry))
        return static, templated


Operation = tuple[str, tuple[str, ...]]  # its label ("POST /api/episodes/{episode_id}/step"), its query's names
_NAMED = 5  # unknown names a refusal quotes; a fuzzer sends dozens
NOT_JSON = "the trainer API takes JSON bodies only: send 'Content-Type: application/json'"


async def not_allowed(dialect: Dialect, allowed: str, scope: Scope, send: Send) -> None:
    """405 for an agent route called with another method, in its dialect's shape."""
    message = f"{scope['method']} is not allowed on {redact(scope['path'])}; use {allowed}"
    body = dialect.error_body(405, "invalid_request_error", message)
    await respond(send, 405, body, [*JSON, (b"allow", allowed.encode())])


def declared_json(scope: Scope) -> bool:
    """Whether the request says its body is JSON (`application/json`, or a `+json` type). A web page may send any
    other type, or none, to another origin without asking first (no CORS preflight)."""
    declared: bytes = dict(scope["headers"]).get(b"content-type", b"")
    media = declared.decode("latin-1").partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _refuse(send: Send, status: int, kind: str, message: str) -> None:
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": error_body(kind, message)})
