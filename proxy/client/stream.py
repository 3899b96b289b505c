"""The trainer's stream (`/api/turns/stream`) from blocking (`TurnStream`) and asyncio (`AsyncTurnStream`) code:
turns arrive as they park, replies go back on the same socket and return after their commit.

    with trainer.stream(max=64) as stream:
        for turn in stream:
            stream.reply(turn.id, "ls -la", lease_id=turn.lease_id)
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from itertools import count
from typing import Any, Self
from urllib.parse import urlencode

import orjson
from websockets.asyncio.client import ClientConnection as AsyncConnection
from websockets.asyncio.client import connect as connect_async
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from proxy import schema
from proxy.client.calls import TrajproxyAPIError, reply_body

_OPTIONS: dict[str, Any] = {"compression": None, "proxy": None, "max_size": 2**28}  # loopback-fast; big turns


def stream_url(base_url: str, episode: str | None, max_turns: int, lease_s: float | None) -> str:
    query = {"max": max_turns} | ({"episode": episode} if episode else {}) | ({"lease": lease_s} if lease_s else {})
    return base_url.rstrip("/").replace("http", "ws", 1) + "/api/turns/stream?" + urlencode(query)


def reply_item(turn_id: str, content: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """A reply for the batch, from `reply`'s arguments (tool_calls, message, error and the reply's extras)."""
    keys = ("tool_calls", "message", "error")
    tool_calls, message, error = (options.pop(key, None) for key in keys)
    return {"turn_id": turn_id, **reply_body(content, tool_calls, message, error, options)}


def refused(error: InvalidStatus) -> TrajproxyAPIError:
    """The server's answer to a handshake it refused (bad token, bad query, unknown episode)."""
    response = error.response
    try:
        detail = orjson.loads(response.body or b"")["error"]
        return TrajproxyAPIError(response.status_code, str(detail["type"]), str(detail["message"]))
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return TrajproxyAPIError(response.status_code, "error", "the stream was refused")


def closed(error: ConnectionClosed) -> TrajproxyAPIError:
    reason = error.rcvd.reason if error.rcvd else "the connection dropped"
    return TrajproxyAPIError(error.rcvd.code if error.rcvd else 1006, "stream_closed", reason)


class _Inbox:
    """What the server has said so far: turns not yet handed out, acknowledgements by message id, the end."""

    def __init__(self) -> None:
        self.turns: deque[schema.Turn] = deque()
        self.acks: dict[int, list[schema.ReplyResult] | TrajproxyAPIError] = {}
        self.ended: str | None = None
        self.ids = count()

    def take(self, raw: str | bytes) -> None:
        message = orjson.loads(raw)
        kind = message["type"]
        if kind == "turns":
            self.turns.extend(schema.Turn.model_validate(turn) for turn in message["turns"])
        elif kind == "results":
            self.acks[message["id"]] = [schema.ReplyResult.model_validate(item) for item in message["results"]]
        elif kind == "error":
            error = TrajproxyAPIError(message["status"], message["error"]["type"], message["error"]["message"])
            self.acks[message["id"] if message["id"] is not None else -1] = error
        elif kind == "end":
            self.ended = message["reason"]

    def handed(self) -> list[schema.Turn]:
        turns = list(self.turns)
        self.turns.clear()
        return turns

    def ack(self, message_id: int) -> list[schema.ReplyResult]:
        result = self.acks.pop(message_id)
        if isinstance(result, TrajproxyAPIError):
            raise result
        return result

    def message(self, replies: Sequence[dict[str, Any]]) -> tuple[int, str]:
        message_id = next(self.ids)
        return message_id, orjson.dumps({"id": message_id, "replies": list(replies)}).decode()


def one(results: list[schema.ReplyResult]) -> schema.Turn:
    """The turn a single reply recorded, or the error it got, raised as the HTTP route would."""
    (result,) = results
    if result.error is not None or result.turn is None:
        error = result.error
        raise TrajproxyAPIError(result.status, error.type if error else "error", error.message if error else "")
    return result.turn


class TurnStream:
    """A blocking stream; not for several threads at once. Closing it gives its unanswered turns back at once."""

    def __init__(self, url: str, headers: dict[str, str], timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._inbox = _Inbox()
        try:
            # legacy=True: the stream owns its connection and closes it itself, rather than within a `with`
            self._socket: ClientConnection = connect(url, additional_headers=headers, legacy=True, **_OPTIONS)
        except InvalidStatus as e:
            raise refused(e) from e

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._socket.close()

    @property
    def ended(self) -> str | None:
        """Why no more turns will come (the stream's episode ended), or None."""
        return self._inbox.ended

    def turns(self, wait_s: float = 30.0) -> list[schema.Turn]:
        """The turns pushed so far, leased; waits up to `wait_s` for the first if none has come."""
        deadline = time.monotonic() + wait_s
        while not self._inbox.turns and self._inbox.ended is None:
            if not self._receive(max(0.0, deadline - time.monotonic())):
                break
        while self._receive(0):  # and any that came meanwhile, without waiting
            pass
        return self._inbox.handed()

    def __iter__(self) -> Iterator[schema.Turn]:
        """Turn after turn, until the stream's episode ends."""
        while self._inbox.ended is None or self._inbox.turns:
            yield from self.turns()

    def reply_many(self, replies: Sequence[dict[str, Any]]) -> list[schema.ReplyResult]:
        """Answer many turns in one message (items as for `TrainerClient.reply_many`); the results once committed."""
        message_id, message = self._inbox.message(replies)
        try:
            self._socket.send(message)
        except ConnectionClosed as e:
            raise closed(e) from e
        while message_id not in self._inbox.acks:
            if not self._receive(self._timeout_s):
                raise TimeoutError(f"no acknowledgement within {self._timeout_s:g} s")
        return self._inbox.ack(message_id)

    def reply(self, turn_id: str, content: str | None = None, **options: Any) -> schema.Turn:
        """Answer one turn, as `TrainerClient.reply` does."""
        return one(self.reply_many([reply_item(turn_id, content, options)]))

    def _receive(self, timeout_s: float) -> bool:
        try:
            self._inbox.take(self._socket.recv(timeout=timeout_s))
        except TimeoutError:
            return False
        except ConnectionClosed as e:
            raise closed(e) from e
        return True


class AsyncTurnStream:
    """The same stream from asyncio code; one task at a time."""

    def __init__(self, url: str, headers: dict[str, str], timeout_s: float) -> None:
        self._url = url
        self._headers = headers
        self._timeout_s = timeout_s
        self._inbox = _Inbox()
        self._socket: AsyncConnection | None = None

    async def __aenter__(self) -> Self:
        try:
            self._socket = await connect_async(self._url, additional_headers=self._headers, **_OPTIONS)
        except InvalidStatus as e:
            raise refused(e) from e
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._socket is not None:
            await self._socket.close()

    @property
    def ended(self) -> str | None:
        return self._inbox.ended

    async def turns(self, wait_s: float = 30.0) -> list[schema.Turn]:
        deadline = time.monotonic() + wait_s
        while not self._inbox.turns and self._inbox.ended is None:
            if not await self._receive(max(0.0, deadline - time.monotonic())):
                break
        return self._inbox.handed()

    async def __aiter__(self) -> AsyncIterator[schema.Turn]:
        while self._inbox.ended is None or self._inbox.turns:
            for turn in await self.turns():
                yield turn

    async def reply_many(self, replies: Sequence[dict[str, Any]]) -> list[schema.ReplyResult]:
        message_id, message = self._inbox.message(replies)
        try:
            await self._open().send(message)
        except ConnectionClosed as e:
            raise closed(e) from e
        while message_id not in self._inbox.acks:
            if not await self._receive(self._timeout_s):
                raise TimeoutError(f"no acknowledgement within {self._timeout_s:g} s")
        return self._inbox.ack(message_id)

    async def reply(self, turn_id: str, content: str | None = None, **options: Any) -> schema.Turn:
        return one(await self.reply_many([reply_item(turn_id, content, options)]))

    def _open(self) -> AsyncConnection:
        if self._socket is None:
            raise RuntimeError("use the stream as `async with client.stream() as stream:`")
        return self._socket

    async def _receive(self, timeout_s: float) -> bool:
        try:
            raw = await asyncio.wait_for(self._open().recv(), timeout_s)  # cancelling recv loses no message
        except TimeoutError:
            return False
        except ConnectionClosed as e:
            raise closed(e) from e
        self._inbox.take(raw)
        return True
