"""The catalog: recorded episodes a page at a time, newest first, filtered, with what a person scanning them wants
to see (how many turns, what reward); what the web page lists. Pages are keyset-paged, so the thousandth page
costs what the first does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.core.values import Episode, EpisodeStatus

Cursor = tuple[float, str]  # an episode's (created_at, id): a page starts after it


@dataclass(frozen=True, slots=True)
class EpisodeQuery:
    statuses: tuple[EpisodeStatus, ...] = ()  # empty: any
    metadata: dict[str, Any] = field(default_factory=dict)  # fields that must equal these (JSON scalars)
    min_reward: float | None = None  # on the episode's return (`values.episode_return`); an episode with no
    max_reward: float | None = None  # reward is left out when either bound is set (as `export` does)
    since: float | None = None  # created at or after (unix time)
    until: float | None = None  # created before
    after: Cursor | None = None  # the last episode of the page before this one
    limit: int = 50


@dataclass(frozen=True, slots=True)
class EpisodeSummary:
    episode: Episode
    turns: int
    reward: float | None  # its return (`values.episode_return`); None if it has no episode-level reward

    @property
    def cursor(self) -> Cursor:
        return self.episode.created_at, self.episode.id


class Catalog(Protocol):
    async def summaries(self, query: EpisodeQuery) -> list[EpisodeSummary]:
        """The episodes matching the query, newest first, starting after `query.after`."""
        ...

    async def episode_counts(self) -> dict[EpisodeStatus, int]:
        """How many episodes there are in each status (statuses with none are left out)."""
        ...

    async def forks_of(self, parent_ids: Sequence[str]) -> list[EpisodeSummary]:
        """The episodes forked from any of these (their metadata's `fork.parent`), oldest first."""
        ...
