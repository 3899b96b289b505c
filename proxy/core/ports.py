"""The core's interfaces to the outside: where turns are recorded, how tokens are counted, who else answers."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Protocol

from proxy.core.values import Episode, EpisodeStatus, JsonObject, Reply, Reward, Tally, Turn


class Store(Protocol):
    """Durable record of episodes, turns and rewards.

    Writes return an awaitable that completes once the write is committed, so a caller can wait for
    durability (before telling anyone) or let it proceed in the background; writes commit in the
    order they were submitted.
    """

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    def add_episode(self, episode: Episode) -> Awaitable[None]: ...

    def save_episode(self, episode: Episode) -> Awaitable[None]: ...

    def add_turn(self, turn: Turn) -> Awaitable[None]: ...

    def save_turns(self, turns: Sequence[Turn]) -> Awaitable[None]: ...

    def add_reward(self, reward: Reward) -> Awaitable[None]: ...

    async def episode(self, episode_id: str) -> Episode | None: ...

    async def episode_by_key_hash(self, key_hash: str) -> Episode | None: ...

    async def episodes(self, status: EpisodeStatus | None, limit: int, offset: int) -> list[Episode]: ...

    async def turn(self, turn_id: str) -> Turn | None: ...

    async def turns(self, episode_id: str) -> list[Turn]: ...

    async def tally(self, episode_id: str) -> Tally:
        """What an episode has used so far, for an open episode this process has not served before."""
        ...

    async def branch_heads(self, episode_id: str, limit: int) -> list[Turn]:
        """The latest turn of each of the episode's `limit` newest branches: where its conversations stand."""
        ...

    async def open_turns(self) -> list[Turn]:
        """Every turn still parked or leased, by episode and seq: at start-up, what a previous process left open."""
        ...

    async def latest_answered(self, episode_id: str, limit: int) -> list[Turn]:
        """The episode's `limit` most recently answered turns, latest first: those an SDK retry may be for."""
        ...

    async def rewards(self, episode_id: str) -> list[Reward]: ...


class TokenCounter(Protocol):
    """Counts tokens for replies whose usage the trainer did not supply."""

    def count_prompt(self, request: JsonObject) -> int: ...

    def count_completion(self, message: JsonObject) -> int: ...


class Upstream(Protocol):
    """A model that can answer a turn in the trainer's place (evaluation, teachers, side calls)."""

    async def complete(self, model: str, request: JsonObject, options: JsonObject) -> Reply:
        """Answer the chat request with `model`; raise UpstreamError if the model fails."""
        ...
