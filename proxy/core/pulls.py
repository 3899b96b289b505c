"""Pulls: trainers lease parked turns, waiting for them if none is parked yet, and turns whose poller left before
receiving them are given back. A lease lives in memory only, costing no write: after a restart its turn is parked
again (a reply naming it still lands, see `Answers`), and the delivery count is recorded with the turn's end."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from proxy.core.episodes import LiveEpisodes
from proxy.core.errors import NoTurnYet
from proxy.core.ledger import Ledger
from proxy.core.parking import ParkingLot
from proxy.core.ports import Store
from proxy.core.values import Episode, Turn


class Pulls:
    def __init__(
        self,
        lot: ParkingLot,
        ledger: Ledger,
        store: Store,
        episodes: LiveEpisodes,
        episode: Callable[[str], Awaitable[Episode]],
        clock: Callable[[], float],
        *,
        lease_s: float,
    ) -> None:
        self._lot = lot
        self._ledger = ledger
        self._store = store
        self._episodes = episodes
        self._episode = episode
        self._now = clock
        self._lease_s = lease_s

    async def pull(self, episode_id: str | None, max_turns: int, wait_s: float, lease_s: float | None) -> list[Turn]:
        """Lease up to `max_turns` parked turns, waiting up to `wait_s` for the first one (no longer than the
        episode, if one is named, stays open)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not (slots := self._lot.take(episode_id, max_turns, lease_s or self._lease_s, self._now())):
            remaining = deadline - loop.time()
            if remaining <= 0 or (episode_id is not None and self._episodes.closed(episode_id)):
                return []
            await self._lot.wait(episode_id, remaining)
        handed = [slot.turn for slot in slots]
        self._ledger.observer.leased(handed)
        return handed

    def release(self, turns: Sequence[Turn]) -> None:
        """Give back leased turns whose poller went away before receiving them."""
        for turn in turns:
            slot = self._lot.get(turn.id)
            if slot is not None and slot.turn.lease_id == turn.lease_id:
                self._lot.release(slot)

    async def next_turn(self, episode_id: str, wait_s: float, lease_s: float | None) -> Turn | None:
        """Lease the episode's next turn, waiting up to `wait_s` for its agent to call; None once the episode
        has ended with nothing left to answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not (turns := await self.pull(episode_id, 1, max(0.0, deadline - loop.time()), lease_s)):
            if (await self._episode(episode_id)).status.closed:
                return None
            if loop.time() >= deadline:
                raise NoTurnYet(
                    f"episode {episode_id}'s agent made no call within {wait_s:g} s and is still running; "
                    "ask again to keep waiting"
                )
        return turns[0]
