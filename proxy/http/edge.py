"""What every route needs at the edge: bodies read within their limits of size and time, credentials, responses and
error statuses, which side a request came in on (TCP, or the sandboxes' socket), and the server's shutdown.

Bodies that stop arriving, or never finish (`timed_body`): neither uvicorn nor granian times out a body, so a client
that sent its headers and part of its body held a socket and a file descriptor until it closed them itself, and one
that sent a byte every 29 s held it for ever. Each read waits at most `body_read_timeout_s`, and the whole body must
have arrived `body_timeout_s` after its request began; past either the read raises BodyStalled (408, and the answer
closes the connection). Once the body is whole, reads wait as long as they like: a parked call listens on them for
its agent hanging up.

The sandboxes' Unix socket: whatever runs in a sandbox is the agent being trained, so the socket serves the routes
an agent calls and a bare `/health`, and nothing of the page (not even its login form, where it could guess the
trainer token), the docs, the OpenAPI document, metrics or the queue counts `/health` shows on TCP.

The shutdown (`Shutdown`): what waits on the trainer's side (a long poll, the stream) ends as the server begins to
stop, at once: left waiting, it held the server for its whole grace and was cancelled with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

import orjson
from starlette.types import Message, Receive, Scope, Send

from proxy.core import errors
from proxy.core.chunks import Body, Chunks
from proxy.core.values import KEY_PREFIX, JsonObject

STATUS: dict[type[errors.TrajproxyError], int] = {
    errors.PayloadTooLarge: 413,
    errors.BodyStalled: 408,
    errors.BadRequest: 400,
    errors.Unauthorized: 401,
    errors.Forbidden: 403,
    errors.NotFound: 404,
    errors.Conflict: 409,
    errors.EpisodeClosed: 410,
    errors.Paused: 429,
    errors.OverBudget: 429,
    errors.Busy: 429,
    errors.NoTurnYet: 408,
    errors.TurnTimeout: 504,
    errors.StorageError: 503,
    errors.ContextFull: 400,  # the agent's request is too long for the model, as OpenAI's API answers it
    errors.UpstreamError: 502,
}


def error_headers(error: errors.TrajproxyError) -> list[tuple[bytes, bytes]]:
    """Headers for an agent-facing error: when to retry, or that retrying will not help."""
    if isinstance(error, errors.Paused):
        return [(b"retry-after", f"{max(1, round(error.retry_after_s))}".encode())]
    if isinstance(error, errors.Busy):
        return [(b"retry-after", b"1")]
    return [(b"x-should-retry", b"false")]


def error_body(kind: str, message: str) -> bytes:
    """OpenAI's error shape, used by the trainer API too."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}})


def invalid(problems: Sequence[Mapping[str, Any]]) -> str:
    """A validation's problems in one line, each with where it is (`replies.0.message: ...`)."""
    described = "; ".join(
        f"{'.'.join(str(part) for part in problem.get('loc', ()))}: {problem.get('msg')}" for problem in problems
    )
    return f"invalid request: {described}"


def status_of(error: errors.TrajproxyError) -> int:
    for kind in type(error).__mro__:
        if kind in STATUS:
            return STATUS[kind]
    return 500


DROPPED_BYTES = 1 << 20  # what is still read, and dropped, of a body over its limit before the refusal
_CHUNKS_KEPT = 64  # a body read in more chunks is joined: each chunk kept is an object, and a step of every read


async def read_body(scope: Scope, receive: Receive, limit_bytes: int) -> bytes:
    """The whole request body, refused (PayloadTooLarge) once it is declared or read past `limit_bytes`: what is left
    of it is read and dropped first, up to `DROPPED_BYTES` more (`drop_body`)."""
    return b"".join(await _read(scope, receive, limit_bytes))  # one chunk: the same object


async def read_chunks(scope: Scope, receive: Receive, limit_bytes: int) -> Body:
    """`read_body`, the body left in the chunks it arrived in where there were more than one: an agent's call holds
    its whole conversation, which joined would be copied once more on every turn."""
    chunks = await _read(scope, receive, limit_bytes)  # one chunk is given as it came (a join of one is that object)
    return Chunks(chunks) if 1 < len(chunks) <= _CHUNKS_KEPT else b"".join(chunks)


async def _read(scope: Scope, receive: Receive, limit_bytes: int) -> list[bytes]:
    """The body's chunks as they were read (`read_body`)."""
    declared = declared_length(scope)
    if declared is not None and declared > limit_bytes:
        if declared <= limit_bytes + DROPPED_BYTES:  # the whole of it, none read yet
            await drop_body(receive, declared)
        raise errors.PayloadTooLarge(f"request body of {declared} bytes is over the {limit_bytes}-byte limit")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: what came is not its call, whatever it parses to
            raise errors.BadRequest("the client closed its connection before the request body was whole")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit_bytes:
            await drop_body(receive, DROPPED_BYTES, message)
            raise errors.PayloadTooLarge(f"request body is over the {limit_bytes}-byte limit")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks


def declared_length(scope: Scope) -> int | None:
    """The body's length as its Content-Length header declares it, where it does."""
    declared = dict(scope["headers"]).get(b"content-length", b"")
    return int(declared) if declared.isdigit() else None


async def drop_body(receive: Receive, most: int, last: Message | None = None) -> None:
    """Read and drop a refused request's body (what is left of it after `last`, the message read last, where some was
    read), up to `most` bytes and as long as it does not stall: a connection closed while its body still arrives is
    reset, and the reset can reach the client before it has read the refusal (its 413 lost). A larger body's
    connection is closed under it."""
    dropped = 0
    with contextlib.suppress(errors.TrajproxyError):  # a stalled body: the refusal is still the one given
        while (last is None or last.get("more_body", False)) and dropped < most:
            last = await receive()
            if last["type"] != "http.request":
                break
            dropped += len(last.get("body", b""))


# Deeper JSON parses (orjson reads 1,024 levels) but cannot be stored or sent back: orjson writes 255 levels at most.
MAX_JSON_DEPTH = 128
TOO_DEEP = f"request body nests JSON arrays and objects deeper than {MAX_JSON_DEPTH} levels"
NOT_UTF8 = "request body is not valid JSON: it holds bytes that are not UTF-8"


def may_nest_too_deep(raw: bytes) -> bool:
    """Whether a JSON body has brackets enough to nest deeper than MAX_JSON_DEPTH: a count, in C, that clears
    almost every body without parsing or walking it."""
    return raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH


def nested_too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the parsed JSON `value` nests arrays and objects deeper than `limit` levels."""
    level, depth = [value], 0
    while level:  # breadth first, one level at a time
        depth += 1
        if depth > limit:
            return True
        level = [
            child
            for container in level
            for child in (container.values() if isinstance(container, dict) else container)
            if isinstance(child, dict | list)
        ]
    return False


def too_deep(body: bytes) -> bool:
    """Whether the body is JSON nested deeper than MAX_JSON_DEPTH (malformed JSON is its route's to refuse)."""
    if not may_nest_too_deep(body):
        return False
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        return str(e).startswith("depth limit exceeded")
    return nested_too_deep(value)


async def read_json(scope: Scope, receive: Receive, limit_bytes: int) -> tuple[bytes, JsonObject]:
    """Read the body (refusing it past `limit_bytes`) and parse it as a JSON object of bounded nesting."""
    raw = await read_body(scope, receive, limit_bytes)
    return raw, parse_json(raw)


def parse_json(raw: bytes) -> JsonObject:
    """A body as a JSON object of bounded nesting; BadRequest if it is not one."""
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if str(e).startswith("depth limit exceeded"):
            raise errors.BadRequest(TOO_DEEP) from None
        raise errors.BadRequest(f"request body is not valid JSON: {e}") from None
    if may_nest_too_deep(raw) and nested_too_deep(body):
        raise errors.BadRequest(TOO_DEEP)
    if not isinstance(body, dict):
        raise errors.BadRequest(f"request body must be a JSON object, not {type(body).__name__}")
    return body


def parse_bearer(header: str | None) -> str | None:
    """The credentials of an `Authorization: Bearer …` header, or None."""
    if header is None:
        return None
    scheme, _, credentials = header.partition(" ")
    return credentials.strip() or None if scheme.lower() == "bearer" else None


def agent_key(in_path: str | None, headers: Mapping[bytes, bytes]) -> str | None:
    """The episode key, from the path (/e/<key>/...), a bearer token, Anthropic's x-api-key or Google's
    x-goog-api-key."""
    if in_path:
        return in_path
    if (bearer := parse_bearer(headers.get(b"authorization", b"").decode("latin-1") or None)) is not None:
        return bearer
    return (headers.get(b"x-api-key") or headers.get(b"x-goog-api-key") or b"").decode("latin-1") or None


def replay(body: bytes, receive: Receive) -> Receive:
    """The body, already read, then the client's own messages (so a long-poll still hears a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


JSON = [(b"content-type", b"application/json")]


async def respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = JSON) -> None:
    """A whole response in two messages, framed by Content-Length (no chunked encoding to pay for)."""
    length = (b"content-length", str(len(body)).encode())
    await send({"type": "http.response.start", "status": status, "headers": [*headers, length]})
    await send({"type": "http.response.body", "body": body})


async def disconnected(receive: Receive) -> None:
    """Returns once the client has gone away."""
    while (await receive())["type"] != "http.disconnect":
        pass


def redact(path: str) -> str:
    """A path fit for messages and logs: an episode key in it is replaced wherever it falls (`//e/<key>/v1`, which
    no route takes, names a key as surely as `/e/<key>/v1`), and so is anything spelled like a key."""
    if "/e/" in path:
        path = _KEY_SEGMENT.sub("/e/<key>", path)
    return _KEY_LIKE.sub("<key>", path) if KEY_PREFIX in path else path


_KEY_SEGMENT = re.compile(r"/e/[^/]*")
_KEY_LIKE = re.compile(re.escape(KEY_PREFIX) + r"[^/?#\s]*")


UPGRADE_REFUSED = "trajproxy serves plain HTTP only: send this request again without 'Upgrade: websocket'"


def asks_upgrade(scope: Scope) -> bool:
    """Whether an HTTP request asks to switch to WebSocket (uvicorn, told not to, passes such requests on)."""
    return any(name == b"upgrade" and value.lower() == b"websocket" for name, value in scope["headers"])


async def refuse_upgrade(scope: Scope, send: Send) -> None:
    """Answer a WebSocket handshake at once with 426, which clients with an HTTP transport (the Codex CLI) take as
    "use HTTP" and do not retry. A server that hands the app WebSocket scopes gets the same answer through the
    denial-response extension where it has it (a bare close, 403, where it does not)."""
    await deny(scope, send, 426, error_body("invalid_request_error", UPGRADE_REFUSED))


async def deny(scope: Scope, send: Send, status: int, body: bytes) -> None:
    """Refuse a request, or a WebSocket handshake before it is accepted, with an HTTP status and a JSON error body.
    A server without the WebSocket denial-response extension can only close the handshake (its client sees 403)."""
    headers = [*JSON, (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    elif "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})


# Bodies that stop arriving

_CLOSE = (b"connection", b"close")


def timed_body(receive: Receive, send: Send, timeout_s: float, whole_s: float) -> tuple[Receive, Send]:
    """`receive` with each read of the body bounded by `timeout_s` and the whole body by `whole_s` from now, and a
    `send` that closes the connection once a read has stalled (the rest of the body would otherwise be read as the
    next request)."""
    timed = _TimedBody(receive, send, timeout_s, whole_s)
    return timed.receive, timed.send


class _TimedBody:
    """One request's timed `receive` and its `send`: an object of slots, held by every request as long as it lasts
    (a parked call's hours), so smaller than the closures and cells it replaced (RESULTS.md, section 36)."""

    __slots__ = ("_deadline", "_receive", "_send", "_stalled", "_timeout_s", "_whole", "_whole_s")

    def __init__(self, receive: Receive, send: Send, timeout_s: float, whole_s: float) -> None:
        self._receive, self._send = receive, send
        self._timeout_s, self._whole_s = timeout_s, whole_s
        self._deadline = asyncio.get_running_loop().time() + whole_s
        self._whole = self._stalled = False

    def receive(self) -> Awaitable[Message]:
        # once the body is whole, the read is the server's own: no frame of this one held while it waits (a parked
        # call waits on it for its agent's hang-up)
        return self._receive() if self._whole else self._timed()

    async def _timed(self) -> Message:
        timeout_s, whole_s = self._timeout_s, self._whole_s
        left_s = self._deadline - asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(min(timeout_s, left_s)):
                message = await self._receive()
        except TimeoutError:
            self._stalled = True
            if left_s <= timeout_s:
                raise errors.BodyStalled(f"the request body did not arrive whole within {whole_s:g} s") from None
            stopped = f"the request body stopped arriving: nothing of it came for {timeout_s:g} s"
            raise errors.BodyStalled(stopped) from None
        self._whole = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    async def send(self, message: Message) -> None:
        if self._stalled and message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), _CLOSE]}
        await self._send(message)


# The sandboxes' socket

SANDBOX_HEALTH = b'{"status":"ok"}'


def from_sandbox(scope: Scope) -> bool:
    """Whether the request came over the Unix socket (it has no port)."""
    server = scope.get("server")
    return server is None or server[1] is None


async def sandbox_health(_scope: Scope, _receive: Receive, send: Send) -> None:
    """`/health` on the sandbox socket: that trajproxy is up, and nothing else."""
    await respond(send, 200, SANDBOX_HEALTH)


async def sandbox_refusal(scope: Scope, _receive: Receive, send: Send) -> None:
    """Answer a request on the sandbox socket that no agent route took."""
    if scope["path"].startswith("/e/"):  # a key in the path, then no agent route: as on TCP
        message = f"no route {scope['method']} {redact(scope['path'])}"
        await deny(scope, send, 404, error_body(errors.NotFound.kind, message))
        return
    message = f"the sandbox socket serves agent routes only, not {redact(scope['path'])}; use trajproxy's TCP address"
    await deny(scope, send, 403, error_body(errors.Forbidden.kind, message))


# The shutdown

SHUTTING_DOWN = "trajproxy is shutting down: retry"
_UNAVAILABLE = [(b"content-type", b"application/json"), (b"retry-after", b"1"), _CLOSE]


class Shutdown:
    """Set once, by the front in front of the app, on the server's event loop, as its shutdown begins."""

    def __init__(self) -> None:
        self._begun = asyncio.Event()

    @property
    def begun(self) -> bool:
        return self._begun.is_set()

    def begin(self) -> None:
        self._begun.set()

    async def wait(self) -> None:
        await self._begun.wait()


async def unavailable(send: Send) -> None:
    """Answer 503 to a request the shutdown ended, unless its answer had begun (a stream then just ends)."""
    try:
        await send({"type": "http.response.start", "status": 503, "headers": _UNAVAILABLE})
        await send({"type": "http.response.body", "body": error_body("unavailable", SHUTTING_DOWN)})
    except (RuntimeError, OSError):  # its answer had begun, or its client is gone: nothing more to say
        return
