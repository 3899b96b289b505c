"""WeightSync: the trainer's weight-update cycle, on every replica: pause new agent calls, let the turns in flight
drain, then resume naming the new policy version that every reply recorded afterwards carries."""

from __future__ import annotations

from proxy.core.answers import Answers
from proxy.core.open_turns import Pause
from proxy.core.queue import Others


class WeightSync:
    def __init__(self, *, pause: Pause, answers: Answers, others: Others | None) -> None:
        self._pause = pause
        self._answers = answers
        self._others = others  # the replicas sharing the database, told of each pause and resume

    @property
    def paused(self) -> str | None:
        return self._pause.mode

    @property
    def policy_version(self) -> str | None:
        return self._answers.policy_version

    async def pause(self, mode: str, retry_after_s: float, drain_s: float = 0.0) -> int:
        """Stop handing out new agent calls (for a weight update): see `Pause`. Every replica pauses. Waits up to
        `drain_s` for the turns in flight on this replica to finish; returns how many still are."""
        self._pause.start(mode, retry_after_s)
        if self._others is not None:
            self._others.pause(mode, retry_after_s)
        return await self._pause.drained(drain_s)

    def resume(self, policy_version: str | None = None) -> int:
        """Release the calls held while paused; returns how many go on (from this replica). Replies recorded from
        now on, on every replica, carry `policy_version` (when given) unless their trainer names another."""
        if policy_version is not None:
            self._answers.policy_version = policy_version
        if self._others is not None:
            self._others.pause(None, 0.0, policy_version)
        return self._pause.lift()
