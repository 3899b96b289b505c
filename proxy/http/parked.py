"""ParkedReply: holds an agent's HTTP exchange open while its turn is parked, then hands over the outcome.

The turn's life while its agent waits (the turn timeout, a hang-up and its retry grace) is the broker's
(`Broker.attend`); this renders what the agent hears, in its dialect: keep-alives, the reply, or an error.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Receive, Scope, Send

from proxy.core.broker import Broker
from proxy.core.errors import TrajproxyError
from proxy.core.parking import Slot
from proxy.core.values import Episode, Turn
from proxy.dialects.dialect import Call, Dialect
from proxy.http.edge import JSON, disconnected, error_headers, respond, status_of

Failure = tuple[int, str, str, list[tuple[bytes, bytes]]]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class ParkedReply:
    def __init__(
        self, broker: Broker, dialect: Dialect, call: Call, slot: Slot, episode: Episode, keepalive_s: float
    ) -> None:
        self._broker = broker
        self._dialect = dialect
        self._call = call
        self._slot = slot
        self._episode = episode
        self._keepalive_s = keepalive_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.ensure_future(disconnected(receive))
        try:
            with self._broker.attend(self._slot, self._episode):
                if self._call.stream:
                    await self._stream(send, gone)
                else:
                    await self._plain(send, gone)
        finally:
            gone.cancel()

    async def _plain(self, send: Send, gone: asyncio.Future[None]) -> None:
        answer = self._slot.answer
        await _either(answer, gone)
        if not answer.done():
            return
        if (failure := self._failure(answer)) is not None:
            await self._refuse(send, failure)
        else:
            await respond(send, 200, self._dialect.render(self._call, answer.result()))
        self._handed_over(answer)

    async def _stream(self, send: Send, gone: asyncio.Future[None]) -> None:
        answer = self._slot.answer
        started = False
        while not answer.done():
            await asyncio.wait((answer, gone), timeout=self._keepalive_s, return_when=asyncio.FIRST_COMPLETED)
            if gone.done():
                return
            if not answer.done():
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": SSE})
                    started = True
                await send({"type": "http.response.body", "body": self._dialect.keepalive, "more_body": True})
        failure = self._failure(answer)
        if not started:
            if failure is not None:  # nothing sent yet: a proper error status, not an event
                await self._refuse(send, failure)
                self._handed_over(answer)
                return
            await send({"type": "http.response.start", "status": 200, "headers": SSE})
        if failure is not None:
            status, kind, message, _ = failure
            body = self._dialect.stream_error(status, kind, message)
        else:
            body = b"".join(self._dialect.render_stream(self._call, answer.result()))
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self._handed_over(answer)

    def _handed_over(self, answer: asyncio.Future[Turn]) -> None:
        """Tell the broker the reply is with the agent's connection (an error a trainer chose counts too)."""
        if not answer.cancelled() and answer.exception() is None:
            self._broker.handed_over(answer.result())

    @staticmethod
    def _failure(answer: asyncio.Future[Turn]) -> Failure | None:
        """Why the agent gets an error instead of the reply (status, kind, message, headers); None if it does not."""
        error = answer.exception()
        if isinstance(error, TrajproxyError):
            return status_of(error), error.kind, error.message, [*JSON, *error_headers(error)]
        if error is not None:
            raise error
        reply = answer.result().reply
        assert reply is not None
        if reply.error is not None:  # the trainer's own error: the SDK's retry rules apply
            return reply.error.status, reply.error.kind, reply.error.message, JSON
        return None

    async def _refuse(self, send: Send, failure: Failure) -> None:
        status, kind, message, headers = failure
        await respond(send, status, self._dialect.error_body(status, kind, message), headers)


async def _either(a: asyncio.Future[Any], b: asyncio.Future[Any]) -> None:
    """Until one of two futures is done: asyncio.wait's work without its generality, which costs several
    times more and runs once per turn."""
    woken = asyncio.get_running_loop().create_future()

    def wake(_: object) -> None:
        if not woken.done():
            woken.set_result(None)

    a.add_done_callback(wake)
    b.add_done_callback(wake)
    try:
        await woken
    finally:
        a.remove_done_callback(wake)
        b.remove_done_callback(wake)
