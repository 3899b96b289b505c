"""The ledger: every open turn settled exactly once, the turns settled lately, and the writes nobody waits on."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

from proxy.core.errors import NotFound, TrajproxyError, TurnClosed
from proxy.core.observer import Observer, Unobserved
from proxy.core.parking import ParkingLot, Slot
from proxy.core.ports import Store
from proxy.core.values import Turn, TurnStatus

log = logging.getLogger("trajproxy")

# The settled turns kept at hand once recorded: the newest 4,096, fewer when their calls are large (a coding agent's
# call can be a megabyte, and the fuzzers sent 16 MiB ones), within about 128 MiB of what they hold. A turn whose
# write is still on its way is kept besides, whatever its size, until the store has it.
_RECENT_TURNS = 4096
_RECENT_BYTES = 128 * 2**20
_BYTES_PER_ID = 36  # a token id or logprob held in a tuple: its pointer and its int or float

UNRECORDED = "the reply could not be recorded"

Ending = tuple[Slot, Turn]  # an open turn's slot, and the turn as it ended


class Ledger:
    def __init__(
        self, lot: ParkingLot, store: Store, clock: Callable[[], float], observer: Observer | None = None
    ) -> None:
        self._lot = lot
        self._store = store
        self._now = clock
        self.observer: Observer = observer or Unobserved()
        self._unwritten: dict[str, Turn] = {}  # settled turns whose write is on its way: their latest state
        self._recent: OrderedDict[str, Turn] = OrderedDict()
        self._recent_bytes = 0
        self._background: set[asyncio.Future[Any]] = set()

    def settle(
        self, endings: Iterable[Ending], told: TrajproxyError | None = None, *, recorded: bool = False
    ) -> tuple[list[Turn | None], asyncio.Future[None] | None]:
        """End open turns, each exactly once, whatever ended them: the one way out of the lot.

        Each turn leaves the lot (one that something else settled first is skipped: None in the list returned), its
        ended state stays at hand, and all are recorded in one write (none if `recorded`: the database replicas share
        holds them already). Once that write is done, committed or not, each agent hears: its turn if answered and
        recorded; for an answer the store refused, why (the turn is then recorded failed); else `told`, why the turn
        ended. The observers hear each turn as it ended for good. Returns the turns settled and the write."""
        settled: list[Ending] = []
        turns: list[Turn | None] = []
        for slot, turn in endings:
            if self._lot.settle(turn.id) is None:
                turns.append(None)
                continue
            slot.turn = turn
            settled.append((slot, turn))
            turns.append(turn)
        if recorded or not settled:
            self._told(settled, told, None)
            return turns, None
        written = self._record([turn for _, turn in settled])
        written.add_done_callback(partial(self._told, settled, told))
        return turns, written

    def end(
        self, slots: Iterable[Slot], status: TurnStatus, reason: str | None, told: TrajproxyError | None = None
    ) -> Awaitable[None]:
        """End open turns for one reason (see `settle`). Returns their write: awaiting it raises if it failed."""
        now = self._now()
        _, written = self.settle(
            ((slot, replace(slot.turn, status=status, reason=reason, ended_at=now, lease_id=None)) for slot in slots),
            told,
        )
        return written if written is not None else _done()

    def remember(self, turn: Turn) -> None:
        """Keep a recorded turn's latest state at hand, within the bounds, the newest first."""
        if (earlier := self._recent.pop(turn.id, None)) is not None:
            self._recent_bytes -= held_bytes(earlier)
        self._recent[turn.id] = turn
        self._recent_bytes += held_bytes(turn)
        while self._recent and (len(self._recent) > _RECENT_TURNS or self._recent_bytes > _RECENT_BYTES):
            _, oldest = self._recent.popitem(last=False)
            self._recent_bytes -= held_bytes(oldest)

    async def turn(self, turn_id: str) -> Turn:
        """A turn's latest state: open in the lot, settled lately, or as the store has it."""
        slot = self._lot.get(turn_id)
        turn = (
            slot.turn
            if slot
            else self._unwritten.get(turn_id) or self._recent.get(turn_id) or await self._store.turn(turn_id)
        )
        if turn is None:
            raise NotFound(f"no turn {turn_id!r}")
        return turn

    def submit(self, write: Awaitable[None]) -> asyncio.Future[None]:
        """Let a write (or a task) proceed in the background; a failure is logged, and `drain` waits for it."""
        future = asyncio.ensure_future(write)
        self._background.add(future)
        future.add_done_callback(self._written)
        return future

    async def drain(self) -> None:
        """Wait for the background writes submitted so far (state changes nobody awaited) to be committed."""
        if pending := list(self._background):
            await asyncio.wait(pending)

    def _record(self, turns: list[Turn]) -> asyncio.Future[None]:
        """Write settled turns, each kept at hand until the write is done (`drain` waits for it)."""
        written = asyncio.ensure_future(self._store.save_turns(turns))
        for turn in turns:
            self._unwritten[turn.id] = turn
        self._background.add(written)
        written.add_done_callback(partial(self._recorded, turns))
        return written

    def _recorded(self, turns: list[Turn], written: asyncio.Future[None]) -> None:
        self._background.discard(written)
        for turn in turns:
            if self._unwritten.get(turn.id) is turn:  # else a later state of it is on its way
                del self._unwritten[turn.id]
                self.remember(turn)

    def _told(self, settled: list[Ending], told: TrajproxyError | None, written: asyncio.Future[None] | None) -> None:
        """Tell each settled turn's agent, and the observers, how it ended, once its write is done."""
        error = None if written is None else failure(written)
        refused: list[Turn] = []
        for slot, turn in settled:
            if written is None:
                self.remember(turn)
            answer = slot.answer
            if error is not None and turn.status is TurnStatus.ANSWERED:  # its agent must not get an unrecorded reply
                slot.turn = turn = replace(turn, status=TurnStatus.FAILED, reason=UNRECORDED)
                refused.append(turn)
                if not answer.done():
                    if isinstance(error, asyncio.CancelledError):
                        answer.cancel()
                    else:
                        slot.fail(error)
            elif not answer.done():
                if turn.status is TurnStatus.ANSWERED:
                    answer.set_result(turn)
                else:
                    slot.fail(told or TurnClosed(f"turn {turn.id} is {turn.status} ({turn.reason})"))
            self.observer.settled(turn)
        if error is not None:
            log.warning("the end of %d turns could not be recorded: %s", len(settled), error)
        if refused:
            self._record(refused)

    def _written(self, future: asyncio.Future[Any]) -> None:
        self._background.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.error("a background write failed", exc_info=future.exception())


def held_bytes(turn: Turn) -> int:
    """About what a settled turn holds in memory: its call as received and as parsed (as much again), and the token
    ids and logprobs of its reply."""
    size = 2 * len(turn.wire)
    if (reply := turn.reply) is not None:
        for values in (reply.prompt_token_ids, reply.completion_token_ids, reply.logprobs):
            if values is not None:
                size += _BYTES_PER_ID * len(values)
    return size


def failure(write: asyncio.Future[Any]) -> BaseException | None:
    """Why a settled write failed, or None if it was committed."""
    return asyncio.CancelledError() if write.cancelled() else write.exception()


def _done() -> asyncio.Future[None]:
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done
