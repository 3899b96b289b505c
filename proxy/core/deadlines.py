"""Deadlines on open turns: how long an agent waits for its reply, and how long a turn waits for its agent.

A turn whose agent hung up leaves the queue at once and waits the retry grace for its SDK's retry (the same
body) to come back for it; one taken back after a restart waits the restart grace, longer, since its agent's
SDK may be deep in its backoff by then. A turn no retry claims is recorded abandoned.
"""

from __future__ import annotations

import asyncio

from proxy.core.errors import TurnTimeout
from proxy.core.ledger import Ledger
from proxy.core.parking import ParkingLot, Slot
from proxy.core.values import Episode, TurnStatus

_HUNG_UP = "the agent disconnected before a reply"
_NOT_BACK = "the proxy restarted and the agent did not come back for its turn"


class Deadlines:
    def __init__(
        self,
        lot: ParkingLot,
        ledger: Ledger,
        *,
        turn_timeout_s: float,
        retry_grace_s: float,
        restart_grace_s: float,
    ) -> None:
        self._lot = lot
        self._ledger = ledger
        self._turn_timeout_s = turn_timeout_s
        self._retry_grace_s = retry_grace_s
        self._restart_grace_s = restart_grace_s

    def expire_later(self, slot: Slot, episode: Episode) -> asyncio.TimerHandle:
        """Start the turn timeout of an agent exchange waiting on `slot.answer`: if no reply has come when it
        passes, the turn is recorded as expired and every exchange waiting on it hears TurnTimeout. The
        exchange cancels the returned timer when it ends."""
        timeout_s = episode.turn_timeout_s or self._turn_timeout_s
        return asyncio.get_running_loop().call_later(timeout_s, self._expire, slot, timeout_s)

    def leave(self, slot: Slot) -> None:
        """An agent exchange ended. If it was the turn's last and the turn is unanswered, the turn leaves the
        queue at once (no trainer receives it afterwards) and is abandoned unless a retry comes back for it
        within the retry grace."""
        slot.exchanges -= 1
        if slot.exchanges > 0 or self._lot.get(slot.turn.id) is not slot:
            return
        self._lot.withdraw(slot)
        slot.grace_timer = asyncio.get_running_loop().call_later(self._retry_grace_s, self._abandon, slot, _HUNG_UP)

    def after_restart(self, slot: Slot) -> None:
        """A turn taken back after a restart, its agent not connected: abandoned unless a retry comes back for
        it within the restart grace."""
        loop = asyncio.get_running_loop()
        slot.grace_timer = loop.call_later(self._restart_grace_s, self._abandon, slot, _NOT_BACK)

    def _expire(self, slot: Slot, timeout_s: float) -> None:
        # If it was answered (or closed) at the last moment, its answer is on the way and this does nothing.
        why = f"no reply to turn {slot.turn.id} within {timeout_s:g} s; the turn is recorded as expired"
        reason = f"no reply within the turn timeout of {timeout_s:g} s"
        self._ledger.end([slot], TurnStatus.EXPIRED, reason, TurnTimeout(why))

    def _abandon(self, slot: Slot, why: str) -> None:
        self._ledger.end([slot], TurnStatus.ABANDONED, why)
