"""Fork plans: how new episodes replay a recorded one's first k calls, then go on under their own policy.

A fork runs its agent afresh. Its call number i (i < k) is matched against the parent's call number i on the
conversation the agent sends; a match is answered with the parent's recorded reply (`answered_by: replay`),
without reaching the trainer. A call that differs beyond what the fork allows (exact by default; named volatile
fields ignored; a similarity bound) ends the replay there: the fork records where and why, and the call goes to
its policy, or fails, as the fork says. The plan lives in the fork's metadata, so a restarted trajproxy carries on.

    metadata["fork"] = {"parent": "ep_…", "at_turn": 3, "ignore": ["metadata"], "min_similarity": 1.0,
                        "on_divergence": "policy", "diverged": {"seq": 2, "why": "…"}}   # the last once it happens
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from proxy.core.errors import BadRequest
from proxy.core.values import JsonObject, Reply, Turn, TurnStatus

OnDivergence = Literal["policy", "fail"]
REPLAYED = "replay"  # answered_by of a replayed turn


@dataclass(frozen=True, slots=True)
class ForkPlan:
    """How a fork replays its parent: which calls, and what counts as the same call."""

    parent: str
    at_turn: int
    ignore: tuple[str, ...] = ()  # field names left out of the comparison, wherever they occur
    min_similarity: float = 1.0  # below 1: calls whose text is at least this similar count as the same
    on_divergence: OnDivergence = "policy"
    diverged: JsonObject | None = None

    def record(self) -> JsonObject:
        """The plan as the fork's metadata keeps it."""
        kept: JsonObject = {
            "parent": self.parent,
            "at_turn": self.at_turn,
            "ignore": list(self.ignore),
            "min_similarity": self.min_similarity,
            "on_divergence": self.on_divergence,
        }
        if self.diverged is not None:
            kept["diverged"] = self.diverged
        return kept

    @classmethod
    def of(cls, metadata: JsonObject) -> ForkPlan | None:
        """The plan in an episode's metadata; None for an episode that is not a fork."""
        kept = metadata.get("fork")
        if not isinstance(kept, dict) or not isinstance(kept.get("parent"), str):
            return None
        return cls(
            kept["parent"],
            int(kept.get("at_turn", 0)),
            tuple(kept.get("ignore") or ()),
            float(kept.get("min_similarity", 1.0)),
            "fail" if kept.get("on_divergence") == "fail" else "policy",
            kept.get("diverged"),
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a fork does with one call: answer it with `reply`, or not (`why` says how it diverged, if it did)."""

    reply: Reply | None = None
    why: str | None = None


@dataclass(slots=True)
class Replay:
    """A fork's recorded calls, in order, and the verdict on each of its agent's calls."""

    plan: ForkPlan
    recorded: Sequence[Turn]

    def verdict(self, seq: int, request: JsonObject) -> Verdict:
        if self.plan.diverged is not None or seq >= self.plan.at_turn:
            return Verdict()
        if seq >= len(self.recorded):
            return Verdict(why=f"call {seq} has no recorded call {seq} in episode {self.plan.parent} to replay")
        parent = self.recorded[seq]
        why = differs(parent.request, request, self.plan.ignore, self.plan.min_similarity)
        if why is not None:
            return Verdict(why=f"call {seq} differs from episode {self.plan.parent}'s: {why}")
        assert parent.reply is not None  # checked when the fork was made
        return Verdict(reply=parent.reply)


def replayable(parent_id: str, turns: Sequence[Turn], at_turn: int) -> list[Turn]:
    """The parent's first `at_turn` calls, each answered with a message; BadRequest says why they cannot be."""
    ordered = sorted(turns, key=lambda turn: turn.seq)[:at_turn]
    if len(ordered) < at_turn:
        raise BadRequest(f"episode {parent_id} has {len(turns)} recorded calls; at_turn must be at most that")
    for turn in ordered:
        if turn.status is not TurnStatus.ANSWERED or turn.reply is None or turn.reply.message is None:
            raise BadRequest(
                f"call {turn.seq} of episode {parent_id} is {turn.status}, not answered with a message: "
                f"a fork can replay only the calls before it (at_turn at most {turn.seq})"
            )
    return ordered


def differs(recorded: Any, sent: Any, ignore: Sequence[str], min_similarity: float) -> str | None:
    """None when the sent call counts as the recorded one; else where (and how much) it differs."""
    where = _first_difference(recorded, sent, set(ignore), "")
    if where is None:
        return None
    if min_similarity < 1.0:
        similarity = difflib.SequenceMatcher(
            None, _canonical(recorded, set(ignore)), _canonical(sent, set(ignore)), autojunk=False
        ).ratio()
        if similarity >= min_similarity:
            return None
        return f"{where} (similarity {similarity:.3f}, below {min_similarity:g})"
    return where


def _first_difference(a: Any, b: Any, ignore: set[str], path: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys(), key=str):
            if key in ignore:
                continue
            here = f"{path}.{_named(key)}" if path else _named(key)
            if key not in a or key not in b:
                return f"{here} is {'new' if key not in a else 'gone'}"
            if (found := _first_difference(a[key], b[key], ignore, here)) is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        for index, (x, y) in enumerate(zip(a, b, strict=False)):
            if (found := _first_difference(x, y, ignore, f"{path}[{index}]")) is not None:
                return found
        return None if len(a) == len(b) else f"{path or 'the call'} has {len(b)} items, not {len(a)}"
    return None if a == b else (path or "the call")


def _named(key: Any) -> str:
    """A key as the path names it: U+0000 written escaped, since the path is stored in the fork's metadata, which
    Postgres cannot hold with U+0000 in it (the forks' index reads metadata)."""
    return str(key).replace("\x00", "\\u0000")


def _canonical(value: Any, ignore: set[str]) -> str:
    def strip(item: Any) -> Any:
        if isinstance(item, dict):
            return {key: strip(inner) for key, inner in item.items() if key not in ignore}
        if isinstance(item, list):
            return [strip(inner) for inner in item]
        return item

    return json.dumps(strip(value), sort_keys=True, ensure_ascii=False)
