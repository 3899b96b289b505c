"""The queue: where open turns wait for trainers, how they are leased and answered.

One interface, two implementations, chosen once when the app is built: `LocalQueue` (this process's open turns is
the queue; one process per database) and `SharedQueue` (replicas share one Postgres database, and the queue is
the database's). `TurnQueue` is what every queue does; the broker never asks which one it has.

Where replicas share the database they must also hear what each one does (a turn parked here, its agent gone, an
episode closed, a pause) and leave the others what one holds when it stops: that is `Others`, which only the shared
queue is, and which the broker is given only then. With none, this process is its database's only one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Protocol

from proxy.core.answers import Answers
from proxy.core.chunks import Body
from proxy.core.episodes import LiveEpisode
from proxy.core.open_turns import OpenTurn, Pause
from proxy.core.values import Turn


class TurnQueue(Protocol):
    answers: Answers  # replies to open turns, from trainers and models

    @property
    def waiting(self) -> int:
        """Trainers' pulls waiting for a turn."""
        ...

    async def start(self, pause: Pause) -> int:
        """Take back the open turns left by a process that stopped (this one's previous run, or a dead replica), for
        their agents' retries; obey `pause` as the others set it. Returns how many turns were taken back."""
        ...

    def add(self, turn: Turn, held_for: str | None) -> Awaitable[None]:
        """Record a new turn; pullable unless `held_for` says why not ("pause", "model")."""
        ...

    async def retried(self, live: LiveEpisode, wire: Body) -> OpenTurn | None:
        """The turn an SDK retry (this exact body) belongs to, open or answered, wherever its first attempt landed."""
        ...

    async def unmarked_retry(self, live: LiveEpisode, wire: Body) -> OpenTurn | None:
        """The turn a call that does not say whether it is a retry (no `x-stainless-retry-count`) belongs to, beyond
        an open turn here no agent waits on: an open turn elsewhere no agent waits on, or the episode's latest turn,
        answered, its reply never handed over (`retries.lost_reply`); None: it is a new call."""
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


class Others(Protocol):
    """The other replicas sharing the database: what they must hear of this one, beyond what the queue they share
    holds already. A write refused as stale is theirs (one of them recorded the episode's next turn first)."""

    async def stop(self) -> None:
        """Leave: what this replica holds goes to the others."""
        ...

    def parked(self, open_turn: OpenTurn) -> None:
        """A call's turn is parked here (a trainer elsewhere may have answered it already)."""
        ...

    def away(self, open_turn: OpenTurn) -> None:
        """An agent's exchange on the turn ended: if that left the turn withdrawn (its agent hung up, unanswered),
        it stays out of every replica's queue until its SDK's retry comes back for it."""
        ...

    async def closed(self, episode_id: str, why: str) -> None:
        """An episode closed: its open turns held by the others fail too."""
        ...

    def pause(self, mode: str | None, retry_after_s: float, policy_version: str | None = None) -> None:
        """Tell the others of a pause (or of its end, None, with the policy version it names)."""
        ...
