"""The observer: what the core tells the outside as turns move, for metrics; by default nobody listens.

The core calls it at each change of state (a turn recorded, leased, settled, its reply handed over to its agent; a
reward added), with the domain values as they stand, so an observer reads its timings off them and the core keeps no
counters of its own.
Calls are synchronous and on the event loop: an observer must be quick and must not raise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from proxy.core.values import Reward, Turn


class Observer(Protocol):
    def recorded(self, turn: Turn) -> None:
        """An agent's call was recorded as a new turn (parked)."""

    def leased(self, turns: Sequence[Turn]) -> None:
        """Turns were handed to a trainer (each with its `leased_at` and `deliveries`: how many leases it has had)."""

    def settled(self, turn: Turn) -> None:
        """An open turn ended for good: answered, failed, expired or abandoned (`ended_at` set)."""

    def handed_over(self, turn: Turn, at: float) -> None:
        """An answered turn's reply was handed over to its agent's connection at `at` (unix time)."""

    def rewarded(self, reward: Reward) -> None:
        """A reward was recorded."""


class Unobserved:
    """The observer nobody listens to."""

    def recorded(self, turn: Turn) -> None:
        pass

    def leased(self, turns: Sequence[Turn]) -> None:
        pass

    def settled(self, turn: Turn) -> None:
        pass

    def handed_over(self, turn: Turn, at: float) -> None:
        pass

    def rewarded(self, reward: Reward) -> None:
        pass
