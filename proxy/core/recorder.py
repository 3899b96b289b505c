"""Recorder: an agent's call written as its episode's next turn, within the episode's budgets, before it is parked."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from proxy.core.chunks import Body
from proxy.core.context import Context
from proxy.core.endings import failure
from proxy.core.episodes import LiveEpisode, closed_error
from proxy.core.errors import Stale
from proxy.core.queue import Others, TurnQueue
from proxy.core.values import EpisodeStatus, Extension, JsonObject, Turn, TurnStatus, new_id

_STALE_TRIES = 8  # an episode whose agent calls through many replicas at once may be read again this often


@dataclass(frozen=True, slots=True)
class _Call:
    """An agent's call, as it is to be recorded."""

    dialect: str
    request: JsonObject
    wire: Body
    stream: bool
    trainable: bool
    held_for: str | None
    extension: Extension | None


class Recorder:
    def __init__(
        self,
        *,
        context: Context,
        queue: TurnQueue,
        others: Others | None,
        over_budget: Callable[[LiveEpisode, str], Awaitable[None]],
        stale: Callable[[LiveEpisode, str], Awaitable[None]],
    ) -> None:
        self._episodes = context.episodes
        self._now = context.clock
        self._queue = queue
        self._stale_tries = 1 if others is None else _STALE_TRIES  # only another replica's write makes one stale
        self._over_budget = over_budget  # refuses the call (or finishes the episode): it raises
        self._stale = stale  # finishes or fails the episode: it raises

    async def record(
        self,
        live: LiveEpisode,
        dialect: str,
        request: JsonObject,
        wire: Body,
        *,
        stream: bool,
        trainable: bool,
        held_for: str | None = None,  # why the turn is out of the queue ("pause", "model")
        extension: Extension | None = None,  # how its request extends an earlier one's
    ) -> Turn:
        """Write the call as its episode's next turn."""
        call = _Call(dialect, request, wire, stream, trainable, held_for, extension)
        async with live.writing_turn:
            for tries_left in range(self._stale_tries, 0, -1):
                try:
                    return await self._write(live, call)
                except Stale:
                    if tries_left == 1:
                        raise
                    await self._episodes.refresh(live)
        raise AssertionError("unreachable")

    async def _write(self, live: LiveEpisode, call: _Call) -> Turn:
        request = call.request
        if live.episode.status.closed:  # finished while this call waited for the one before it
            raise closed_error(live.episode)
        now = self._now()
        if (over := live.episode.budget.exceeded(live.next_seq, live.tokens, now)) is not None:
            await self._over_budget(live, over)
        if (stale := live.episode.budget.stale(live.versions, self._queue.answers.versions)) is not None:
            await self._stale(live, stale)
        model = request.get("model")
        place = live.branches.locate(request, call.extension)
        turn = Turn(
            id=new_id("tu"),
            episode_id=live.episode.id,
            seq=live.next_seq,
            dialect=call.dialect,
            request=request,
            wire=call.wire,
            stream=call.stream,
            status=TurnStatus.PARKED,
            created_at=now,
            model=model if isinstance(model, str) else None,
            trainable=call.trainable,
            branch=place.branch,
            parent_id=place.parent_id,
            extends=call.extension,
        )

        def took(written: asyncio.Future[None]) -> None:
            if failure(written) is None:
                live.took(turn, place)

        # Taken when the write settles, not when this call resumes: a call cancelled meanwhile whose turn was
        # recorded still takes its seq, or the next call's turn would collide with it.
        written = asyncio.ensure_future(self._queue.add(turn, call.held_for))
        written.add_done_callback(took)
        if live.episode.status is EpisodeStatus.PENDING:
            await self._episodes.start(live, written, now)
        await asyncio.shield(written)
        return turn
