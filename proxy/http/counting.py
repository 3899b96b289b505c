"""CountTokens: Anthropic's `POST /v1/messages/count_tokens` and Gemini's `:countTokens`, which park nothing and need
only an episode key.

So its work is bounded per episode: at most COUNTS_PER_EPISODE at once (more are refused at once with 429 and
`retry-after`, before their bodies are read) and MAX_COUNT_BYTES a body (413). Parsing and counting run off the
event loop, so the server goes on answering while a large prompt is counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from starlette.types import Receive, Scope, Send

from proxy.core.broker import Broker
from proxy.core.errors import Busy, TrajproxyError
from proxy.core.values import JsonObject
from proxy.dialects.dialect import Call
from proxy.http.edge import JSON, agent_key, error_headers, parse_json, read_body, respond, status_of

COUNTS_PER_EPISODE = 2
MAX_COUNT_BYTES = 8 * 2**20  # a long conversation with a few images; the calls themselves take max_body_bytes


class Counting(Protocol):
    """A dialect that counts: its call parsed, the count in its own words, errors in its own shape."""

    def parse(self, body: JsonObject) -> Call: ...

    def count_body(self, tokens: int) -> bytes: ...

    def error_body(self, status: int, kind: str, message: str) -> bytes: ...


class CountTokens:
    """One for the server: the bound on counts in flight is per episode, whatever the dialect."""

    def __init__(self, broker: Broker, max_body_bytes: int) -> None:
        self._broker = broker
        self._limit_bytes = min(max_body_bytes, MAX_COUNT_BYTES)
        self._running: dict[str, int] = {}  # episode id -> counts in flight

    async def __call__(self, dialect: Counting, key: str | None, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            episode = await self._broker.authenticate(agent_key(key, dict(scope["headers"])))
            with self._place(episode.id):
                raw = await read_body(scope, receive, self._limit_bytes)
                tokens = await asyncio.to_thread(self._count, dialect, raw)
        except TrajproxyError as e:
            status = status_of(e)
            body = dialect.error_body(status, e.kind, e.message)
            await respond(send, status, body, [*JSON, *error_headers(e)])
            return
        await respond(send, 200, dialect.count_body(tokens))

    def _count(self, dialect: Counting, raw: bytes) -> int:
        return self._broker.count_tokens(dialect.parse(parse_json(raw)).request)

    @contextmanager
    def _place(self, episode_id: str) -> Iterator[None]:
        running = self._running.get(episode_id, 0)
        if running >= COUNTS_PER_EPISODE:
            raise Busy(f"this episode has {running} count_tokens calls running already, as many as it may")
        self._running[episode_id] = running + 1
        try:
            yield
        finally:
            if (left := self._running[episode_id] - 1) > 0:
                self._running[episode_id] = left
            else:
                del self._running[episode_id]
