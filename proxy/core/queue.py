"""The queue: where open turns wait for trainers, how they are leased and answered, and who else must hear of it.

One interface, two implementations, chosen once when the app is built: `LocalQueue` (this process's parking lot is
the queue; one process per database) and `SharedQueue` (replicas share one Postgres database, and the queue is
the database's). The broker never asks which one it has.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Protocol

from proxy.core.answers import Answers
from proxy.core.episodes import LiveEpisode
from proxy.core.parking import Slot
from proxy.core.pause import Pause
from proxy.core.values import Turn


class TurnQueue(Protocol):
    answers: Answers  # replies to open turns, from trainers and models
    retries_stale: bool  # whether a turn refused as stale (another process recorded the episode's next) is retried

    @property
    def waiting(self) -> int:
        """Trainers' pulls waiting for a turn."""
        ...

    async def start(self, pause: Pause) -> int:
        """Take back the open turns left by a process that stopped (this one's previous run, or a dead replica), for
        their agents' retries; obey `pause` as the others set it. Returns how many turns were taken back."""
        ...

    async def stop(self) -> None:
        """Leave: what this process holds goes to the others, if any."""
        ...

    def add(self, turn: Turn, held_for: str | None) -> Awaitable[None]:
        """Record a new turn; pullable unless `held_for` says why not ("pause", "model")."""
        ...

    def parked(self, slot: Slot) -> None:
        """A call's turn is parked in this process's lot."""
        ...

    async def retried(self, live: LiveEpisode, wire: bytes) -> Slot | None:
        """The turn an SDK retry (this exact body) belongs to, open or answered, wherever its first attempt landed."""
        ...

    def away(self, slot: Slot) -> None:
        """An agent's exchange on the turn ended: if that left the turn withdrawn (its agent hung up, unanswered),
        it stays out of every queue until its SDK's retry comes back for it."""
        ...

    async def closed(self, episode_id: str, why: str) -> None:
        """An episode closed: its open turns held elsewhere fail too."""
        ...

    async def turn(self, turn_id: str) -> Turn:
        """A turn's latest state, its lease as the queue has it."""
        ...

    async def pull(self, episode_id: str | None, max_turns: int, wait_s: float, lease_s: float | None) -> list[Turn]:
        """Lease up to `max_turns` parked turns, waiting up to `wait_s` for the first one (no longer than the
        episode, if one is named, stays open)."""
        ...

    def release(self, turns: Sequence[Turn]) -> None:
        """Give back leased turns whose poller went away before receiving them."""
        ...

    def pause(self, mode: str | None, retry_after_s: float, policy_version: str | None = None) -> None:
        """Tell the others of a pause (or of its end, None, with the policy version it names)."""
        ...
