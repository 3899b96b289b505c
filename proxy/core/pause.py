"""Pausing new agent calls while a trainer updates its policy weights: new calls are held out of the queue until
resume (`hold` and `keep`; their streams get keep-alives) or answered 429 with a Retry-After (`reject`). A served
policy's new calls wait the same way: none reaches its server until resume. With `hold` the pause waits for the
turns in flight to drain; with `keep` it does not: a served call already sent finishes on the weights it was sent
to, and its reply carries the version it was sent under; every call after a resume that names a `policy_version`
carries it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from proxy.core.errors import BadRequest, Paused
from proxy.core.parking import ParkingLot, Slot
from proxy.core.values import Answerer

_DRAIN_POLL_S = 0.02
MODES = ("hold", "keep", "reject")
HOLDING = ("hold", "keep")


class Pause:
    def __init__(self, lot: ParkingLot, answer: Callable[[Slot, Answerer], None]) -> None:
        self._lot = lot
        self._answer = answer  # hand a held turn to the model that answers it
        self.mode: str | None = None  # hold | keep | reject, while paused
        self._retry_after_s = 0.0
        self._held: list[tuple[Slot, Answerer | None]] = []

    def start(self, mode: str, retry_after_s: float) -> None:
        if mode not in MODES:
            raise BadRequest(f"pause mode must be hold, keep or reject, not {mode!r}")
        self.mode, self._retry_after_s = mode, retry_after_s

    def lift(self) -> int:
        """Release the calls held while paused (those whose agent still waits) to the queue, or to the served
        policy that answers them; returns how many."""
        self.mode = None
        held, self._held = self._held, []
        released = [(slot, by) for slot, by in held if slot.exchanges > 0 and self._lot.get(slot.turn.id) is slot]
        for slot, by in released:
            if by is None:
                self._lot.restore(slot)
            else:
                self._answer(slot, by)
        return len(released)

    @property
    def in_flight(self) -> int:
        """Open turns not held by the pause: parked for a trainer, leased, or being answered by a model."""
        return len(self._lot) - sum(self._lot.get(slot.turn.id) is slot for slot, _ in self._held)

    async def drained(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for no turn to be in flight; returns how many still are."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.in_flight and loop.time() < deadline:  # noqa: ASYNC110 (the lot announces no settling; brief)
            await asyncio.sleep(_DRAIN_POLL_S)
        return self.in_flight

    def refuse_if_rejecting(self) -> None:
        if self.mode == "reject":
            raise Paused("the trainer has paused new calls (a policy update); retry shortly", self._retry_after_s)

    def hold_if_holding(self, slot: Slot, now: float, by: Answerer | None = None) -> bool:
        """A new call parked while paused to hold: out of the queue (or kept from the served policy `by`) until
        resume. False if not paused."""
        if self.mode not in HOLDING:
            return False
        if by is None:
            self._lot.withdraw(slot)
        else:
            self._lot.hold(slot, now)
        self._held.append((slot, by))
        return True
