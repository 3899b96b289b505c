"""WeightSync: the trainer's weight-update cycle, on every replica: pause new agent calls, let the turns in flight
drain, then resume naming the new policy version that every reply recorded afterwards carries."""

from __future__ import annotations

from proxy.core.pause import Pause
from proxy.core.queue import TurnQueue


class WeightSync:
    def __init__(self, *, pause: Pause, queue: TurnQueue) -> None:
        self._pause = pause
        self._queue = queue

    @property
    def paused(self) -> str | None:
        return self._pause.mode

    @property
    def policy_version(self) -> str | None:
        return self._queue.answers.policy_version

    async def pause(self, mode: str, retry_after_s: float, drain_s: float = 0.0) -> int:
        """Stop handing out new agent calls (for a weight update): see `Pause`. Every replica pauses. Waits up to
        `drain_s` for the turns in flight on this replica to finish; returns how many still are."""
        self._pause.start(mode, retry_after_s)
        self._queue.pause(mode, retry_after_s)
        return await self._pause.drained(drain_s)

    def resume(self, policy_version: str | None = None) -> int:
        """Release the calls held while paused; returns how many go on (from this replica). Replies recorded from
        now on, on every replica, carry `policy_version` (when given) unless their trainer names another."""
        if policy_version is not None:
            self._queue.answers.policy_version = policy_version
        self._queue.pause(None, 0.0, policy_version)
        return self._pause.lift()
