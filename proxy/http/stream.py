"""TurnStream: the trainer's WebSocket (`GET /api/turns/stream`): leased turns pushed as they park, replies sent
back on the same socket and acknowledged after their commit.

Leases are those of `GET /api/turns/next`: a turn pushed and not answered when its socket closes goes back to the
queue at once, one whose lease runs out goes back too (a reply under the old lease is then refused with 409), and
a reply sent twice is recorded once. At most `max` turns are pushed and not yet replied to: each reply frees room
for one more (credit, so a slow trainer is never flooded).

Messages are JSON, in text (or binary) frames:

    trainer → server  {"id": 7, "replies": [<an item of POST /api/turns/replies>, ...]}
    server → trainer  {"type": "turns", "turns": [<an item of GET /api/turns/next>, ...]}
                      {"type": "results", "id": 7, "results": [<a result of POST /api/turns/replies>, ...]}
                      {"type": "error", "id": 7, "status": 422, "error": {"type": ..., "message": ...}}
                      {"type": "end", "reason": ...}  (the stream's episode has ended: nothing more to push)

A malformed message is answered with an error and the socket stays open; a failing database closes it with 1011
and the reason; a server that begins to stop closes it with 1012 (service restart: connect again).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any
from urllib.parse import parse_qsl

import msgspec
import orjson
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from proxy import schema
from proxy.core.broker import Broker
from proxy.core.errors import TrajproxyError
from proxy.core.values import Turn
from proxy.http.edge import TOO_DEEP, Shutdown, deny, error_body, invalid, status_of, too_deep
from proxy.http.turns import answer_all, turn_view
from proxy.schema import replies

PULL_WAIT_S = 30.0  # one long poll after another; its length only sets how often an idle stream looks again
_INTERNAL_ERROR = 1011
_SERVICE_RESTART = 1012  # what uvicorn closes with when it stops, too
_MAX_REASON_BYTES = 123  # what a close frame holds
_REPLIES = msgspec.json.Decoder(replies.StreamReplies)


class TurnStream:
    """The ASGI app for the stream's WebSocket scope; the trainer's door (`proxy.http.routes`) has checked the token
    before it."""

    def __init__(self, broker: Broker, shutdown: Shutdown) -> None:
        self._broker = broker
        self._shutdown = shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            query = schema.StreamQuery.model_validate(dict(parse_qsl(scope["query_string"].decode("latin-1"), True)))
            if query.episode is not None:
                await self._broker.episode(query.episode)  # 404 for an unknown episode, before the handshake
        except ValidationError as e:
            await deny(scope, send, 422, error_body("invalid_request_error", invalid(e.errors())))
            return
        except TrajproxyError as e:
            await deny(scope, send, status_of(e), error_body(e.kind, e.message))
            return
        if (await receive())["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        await _Session(self._broker, query, send).run(receive, self._shutdown)


class _Session:
    """One open stream: the turns it holds leases on, and the room it has for more."""

    def __init__(self, broker: Broker, query: schema.StreamQuery, send: Send) -> None:
        self._broker = broker
        self._query = query
        self._send = send
        self._in_flight: dict[str, Turn] = {}
        self._room = asyncio.Event()
        self._room.set()
        self._answering: set[asyncio.Task[None]] = set()
        self._closed = False

    async def run(self, receive: Receive, shutdown: Shutdown) -> None:
        pusher = asyncio.ensure_future(self._push())
        ending = asyncio.ensure_future(self._end_with(shutdown))
        try:
            while (message := await receive())["type"] == "websocket.receive":
                # Each message's replies are recorded while the next is read: messages that come together share
                # a commit, as replies sent at once over HTTP do. Acknowledgements say which message by its id.
                answering = asyncio.ensure_future(self._answer(message.get("text") or message.get("bytes") or b""))
                self._answering.add(answering)
                answering.add_done_callback(self._answering.discard)
        finally:
            pusher.cancel()
            ending.cancel()
            await asyncio.wait([pusher, ending, *self._answering])  # replies sent are recorded, whoever hears of it
            self._broker.queue.release(list(self._in_flight.values()))  # at once, not when the leases run out

    async def _push(self) -> None:
        episode = self._query.episode
        try:
            while True:
                await self._room.wait()
                room = self._query.max - len(self._in_flight)
                turns = await self._broker.queue.pull(episode, room, PULL_WAIT_S, self._query.lease)
                if not turns:
                    if episode is not None and (await self._broker.episode(episode)).status.closed:
                        await self._message({"type": "end", "reason": f"episode {episode} has ended"})
                        return
                    continue
                for turn in turns:
                    self._in_flight[turn.id] = turn
                if len(self._in_flight) >= self._query.max:
                    self._room.clear()
                await self._message({"type": "turns", "turns": [turn_view(turn) for turn in turns]})
        except OSError:  # gone; `run` gives its turns back
            return
        except TrajproxyError as e:
            await self._close(e.message)

    async def _end_with(self, shutdown: Shutdown) -> None:
        """Close the stream once the server begins to stop: the trainer hears it at once, not after the grace."""
        await shutdown.wait()
        await self._close("trajproxy is shutting down", _SERVICE_RESTART)

    async def _answer(self, data: str | bytes) -> None:
        """Record a message's replies and acknowledge them, or say what is wrong with it."""
        try:
            await self._answer_or_refuse(data)
        except OSError:  # the trainer went away before it heard
            pass
        except TrajproxyError as e:  # the database failed: nothing on this socket can be trusted to commit
            await self._close(e.message)

    async def _answer_or_refuse(self, data: str | bytes) -> None:
        if too_deep(data.encode() if isinstance(data, str) else data):
            await self._refuse(data, 400, TOO_DEEP)
            return
        try:
            batch = _decoded(data)
        except ValidationError as e:
            problems = e.errors()
            if any(problem.get("type") == "json_invalid" for problem in problems):
                await self._refuse(data, 400, "message is not valid JSON")
            else:
                await self._refuse(data, 422, invalid(problems))
            return
        results = await answer_all(self._broker, batch.replies)
        for item in batch.replies:
            held = self._in_flight.get(item.turn_id)
            if held is not None and item.lease_id in (None, held.lease_id):
                del self._in_flight[item.turn_id]
        if len(self._in_flight) < self._query.max:
            self._room.set()
        await self._message({"type": "results", "id": batch.id, "results": results})

    async def _refuse(self, data: str | bytes, status: int, message: str) -> None:
        error = {"type": "invalid_request_error", "message": message}
        await self._message({"type": "error", "id": _id_of(data), "status": status, "error": error})

    async def _message(self, value: dict[str, Any]) -> None:
        if self._closed:  # by `_close`: the server may send nothing after it
            return
        await self._send({"type": "websocket.send", "text": orjson.dumps(value).decode()})

    async def _close(self, reason: str, code: int = _INTERNAL_ERROR) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            reason = reason.encode()[:_MAX_REASON_BYTES].decode(errors="ignore")
            await self._send({"type": "websocket.close", "code": code, "reason": reason})


def _decoded(data: str | bytes) -> replies.StreamReplies | schema.StreamReplies:
    """The message as Structs; what they refuse, the pydantic model may accept (`5.0` for an integer) or refuses
    with a ValidationError naming the field."""
    try:
        return _REPLIES.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):  # the last: bytes that are not UTF-8
        return schema.StreamReplies.model_validate_json(data)


def _id_of(data: str | bytes) -> Any:
    """The id of a message refused, where one can be read, so the trainer knows which of its messages it was."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    found = value.get("id") if isinstance(value, dict) else None
    return found if isinstance(found, int | str) and not isinstance(found, bool) else None
