"""Rewards: a finite value, named, for an episode or one of its turns, recorded and told to the observer."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

from proxy.core.context import Context
from proxy.core.errors import BadRequest, NotFound
from proxy.core.values import Episode, JsonObject, Reward, new_id


class Rewards:
    def __init__(self, *, context: Context, episode: Callable[[str], Awaitable[Episode]]) -> None:
        self._store = context.store
        self._endings = context.endings
        self._episode = episode
        self._now = context.clock

    async def add(
        self, episode_id: str, name: str, value: float, *, source: str, info: JsonObject, turn_id: str | None = None
    ) -> Reward:
        if not math.isfinite(value):
            raise BadRequest(f"reward {name!r} must be a finite number, not {value}")
        await self._episode(episode_id)  # NotFound for an unknown episode
        if turn_id is not None and (await self._endings.turn(turn_id)).episode_id != episode_id:
            raise NotFound(f"episode {episode_id} has no turn {turn_id!r}")
        reward = Reward(new_id("rw"), episode_id, name, value, source, self._now(), turn_id, info)
        await self._store.add_reward(reward)
        self._endings.observer.rewarded(reward)
        return reward

    async def of(self, episode_id: str) -> list[Reward]:
        """The episode's rewards, in the order they were recorded."""
        await self._episode(episode_id)
        return await self._store.rewards(episode_id)
