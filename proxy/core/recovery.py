"""Recovery after a restart: the open turns a previous process left in the store (it stopped or crashed holding
them), sorted into those to take back and those whose episode has closed since."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, replace

from proxy.core.episodes import LiveEpisode, LiveEpisodes
from proxy.core.open_turns import OpenTurn, OpenTurns
from proxy.core.ports import Store
from proxy.core.values import Answerer, Turn, TurnStatus


@dataclass(frozen=True, slots=True)
class LeftOpen:
    """What a previous process left open: turns of open episodes, each with its episode's live state, and
    turns of closed ones (the record of their closing was lost with the process), now failed."""

    waiting: list[tuple[LiveEpisode, Turn]]
    closed: list[Turn]
    episodes: int


async def left_open(store: Store, episodes: LiveEpisodes, now: float) -> LeftOpen:
    """The open turns the store holds, sorted by whether their episode is still open."""
    by_episode: dict[str, list[Turn]] = {}
    for turn in await store.open_turns():
        by_episode.setdefault(turn.episode_id, []).append(turn)
    lives = await asyncio.gather(*(episodes.load(episode_id) for episode_id in by_episode))
    waiting: list[tuple[LiveEpisode, Turn]] = []
    closed: list[Turn] = []
    for live, turns in zip(lives, by_episode.values(), strict=True):
        if live is None:
            closed += [replace(turn, status=TurnStatus.FAILED, ended_at=now, reason="episode closed") for turn in turns]
        else:
            waiting += [(live, turn) for turn in turns]
    return LeftOpen(waiting, closed, len(by_episode))


def adopt(left: LeftOpen, open_turns: OpenTurns, lease_s: float) -> Iterator[tuple[OpenTurn, Answerer | None]]:
    """Each waiting turn put back among the open turns (a leased one keeps its lease, renewed), with the model that
    answers it, if one does."""
    for live, turn in left.waiting:
        yield open_turns.adopt(turn, lease_s), live.answerer(turn.request)
