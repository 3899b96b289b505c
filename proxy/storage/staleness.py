"""Staleness bounds on exported samples, for training asynchronously: a turn answered by weights more than
`max_behind` versions older than the newest gets no loss, and a sample that holds more than `max_versions`
versions is left out.

Versions are ordered by when each first answered a turn in the database: the order the trainer named them in.
A turn with no version counts as older than every named one.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, func, select

from proxy.core.values import JsonObject
from proxy.storage.sql import turns


@dataclass(frozen=True, slots=True)
class Staleness:
    max_behind: int | None = None  # mask turns more than this many versions older than the newest
    max_versions: int | None = None  # drop samples holding more versions than this


UNBOUNDED = Staleness()


@dataclass(slots=True)
class Bounded:
    """What the bounds did: turns masked, samples dropped."""

    masked_turns: int = 0
    dropped_samples: int = 0


def version_order(conn: Connection) -> dict[str, int]:
    """Each policy version's place, oldest first, by the first turn it answered."""
    first = func.min(turns.c.answered_at)
    query = (
        select(turns.c.policy_version, first)
        .where(turns.c.policy_version.is_not(None))
        .group_by(turns.c.policy_version)
        .order_by(first, turns.c.policy_version)
    )
    return {version: place for place, (version, _) in enumerate(conn.execute(query))}


def bound(lines: list[JsonObject], order: dict[str, int], staleness: Staleness, done: Bounded) -> list[JsonObject]:
    """The lines within the bounds: stale turns masked (`stale_turns` says how many), lines with too many versions
    left out; `done` counts both."""
    newest = len(order) - 1
    kept = []
    for line in lines:
        versions = {span["policy_version"] for span in line["turns"]}
        if staleness.max_versions is not None and len(versions) > staleness.max_versions:
            done.dropped_samples += 1
            continue
        if staleness.max_behind is not None:
            for span in line["turns"]:
                place = order.get(span["policy_version"], -1)
                if newest - place > staleness.max_behind:
                    start, end = span["start"], span["end"]
                    line["loss_mask"][start:end] = [0] * (end - start)
                    if line["logprobs"] is not None:
                        line["logprobs"][start:end] = [0.0] * (end - start)
                    line["stale_turns"] += 1
                    done.masked_turns += 1
        kept.append(line)
    return kept
