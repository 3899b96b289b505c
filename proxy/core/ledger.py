"""The ledger: every open turn settled exactly once, the turns settled lately, and the writes nobody waits on."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from proxy.core.errors import NotFound
from proxy.core.observer import Observer, Unobserved
from proxy.core.parking import ParkingLot, Slot
from proxy.core.ports import Store
from proxy.core.values import Turn, TurnStatus

log = logging.getLogger("trajproxy")

# The settled turns kept at hand: the newest 4,096, fewer when their calls are large (each holds its request, as
# received and as parsed: a coding agent's call can be a megabyte), but never fewer than the newest 64, so that a
# turn's latest state stays here until its write is committed.
_RECENT_TURNS = 4096
_RECENT_BYTES = 64 * 2**20  # of the calls' bodies as received
_RECENT_AT_LEAST = 64


class Ledger:
    def __init__(
        self, lot: ParkingLot, store: Store, clock: Callable[[], float], observer: Observer | None = None
    ) -> None:
        self._lot = lot
        self._store = store
        self._now = clock
        self.observer: Observer = observer or Unobserved()
        self._recent: OrderedDict[str, Turn] = OrderedDict()
        self._recent_bytes = 0
        self._background: set[asyncio.Future[Any]] = set()

    def close(self, slot: Slot, status: TurnStatus, reason: str | None, **changes: Any) -> Turn | None:
        """Settle an open turn once, whatever ended it; None if something else settled it first."""
        if self._lot.settle(slot.turn.id) is None:
            return None
        turn = replace(slot.turn, status=status, reason=reason, ended_at=self._now(), lease_id=None, **changes)
        slot.turn = turn
        self.remember(turn)
        self.observer.settled(turn)
        return turn

    def remember(self, turn: Turn) -> None:
        """Keep a settled turn's latest state at hand (its write may still be on the way)."""
        if (earlier := self._recent.pop(turn.id, None)) is not None:
            self._recent_bytes -= len(earlier.wire)
        self._recent[turn.id] = turn
        self._recent_bytes += len(turn.wire)
        while len(self._recent) > _RECENT_TURNS or (
            self._recent_bytes > _RECENT_BYTES and len(self._recent) > _RECENT_AT_LEAST
        ):
            _, oldest = self._recent.popitem(last=False)
            self._recent_bytes -= len(oldest.wire)

    async def turn(self, turn_id: str) -> Turn:
        """A turn's latest state: open in the lot, settled lately, or as the store has it."""
        slot = self._lot.get(turn_id)
        turn = slot.turn if slot else self._recent.get(turn_id) or await self._store.turn(turn_id)
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

    def _written(self, future: asyncio.Future[Any]) -> None:
        self._background.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.error("a background write failed", exc_info=future.exception())


def failure(write: asyncio.Future[Any]) -> BaseException | None:
    """Why a settled write failed, or None if it was committed."""
    return asyncio.CancelledError() if write.cancelled() else write.exception()
