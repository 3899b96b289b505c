"""An episode's forks as a person reads them: the episode it was forked from, and the tree of those forked from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.core.catalog import Catalog, EpisodeSummary
from proxy.core.fork_plan import ForkPlan
from proxy.core.values import Episode

MAX_DEPTH = 8  # forks of forks shown below an episode
MAX_SHOWN = 256  # forks shown in all; the rest are counted out, level by level


@dataclass(frozen=True, slots=True)
class ForkNode:
    summary: EpisodeSummary
    plan: ForkPlan  # at which turn it was forked, and where its replay stopped, if it did
    children: list[ForkNode] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Lineage:
    origin: ForkPlan | None  # how this episode was forked from its parent; None if it is no fork
    forks: list[ForkNode]  # the episodes forked from this one, oldest first, each with its own forks
    cut: bool = False  # more forks exist than are shown


async def lineage(catalog: Catalog, episode: Episode) -> Lineage:
    """Where `episode` came from, and its forks down to MAX_DEPTH levels, one query a level."""
    nodes: dict[str, list[ForkNode]] = {episode.id: []}
    level, shown = [episode.id], 0
    for _ in range(MAX_DEPTH):
        found = await catalog.forks_of(level) if level else []
        level = []
        for summary in found:
            plan = ForkPlan.of(summary.episode.metadata)
            if plan is None or plan.parent not in nodes or shown >= MAX_SHOWN:
                continue
            node = ForkNode(summary, plan)
            nodes[plan.parent].append(node)
            nodes[summary.episode.id] = node.children
            level.append(summary.episode.id)
            shown += 1
        if shown >= MAX_SHOWN:
            return Lineage(ForkPlan.of(episode.metadata), nodes[episode.id], cut=True)
    return Lineage(ForkPlan.of(episode.metadata), nodes[episode.id], cut=bool(level))
