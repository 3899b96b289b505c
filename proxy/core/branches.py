"""Which conversation a call continues: the branches of an episode's trajectory.

An agent's calls usually extend one conversation: each request repeats the previous one's messages and adds
the reply and what followed. A request that does not (the agent compacted its context, started a sub-agent,
or asked a side question) opens a new branch. Messages are compared by role, text and tool-call ids only, so
markers agents move between calls (Anthropic's `cache_control`) and re-serialised tool arguments do not
break a conversation in two.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from proxy.core.values import JsonObject, Turn, text_of

HEADS_KEPT = 64


@dataclass(frozen=True, slots=True)
class Place:
    """Where a call goes: its branch, and the turn it extends (None when it opens the branch)."""

    branch: int
    parent_id: str | None
    prints: tuple[int, ...]


@dataclass(slots=True, eq=False)
class _Head:
    branch: int
    turn_id: str
    prints: tuple[int, ...]


class Branches:
    """The latest call of each branch of one episode (of its `HEADS_KEPT` newest branches).

    Heads are kept by branch (oldest first) and by how many messages they hold. A call is placed by looking only at
    heads shorter than it, longest first: an episode of calls that all repeat one prompt (a sampling loop) has a
    head per call, all as long as the next call, and none is compared."""

    def __init__(self, next_branch: int = 0) -> None:
        self._heads: dict[int, _Head] = {}  # by branch, in the order the branches opened
        self._by_length: dict[int, list[_Head]] = {}  # by len(prints)
        self._next = next_branch

    @classmethod
    def resume(cls, next_branch: int, heads: Iterable[Turn]) -> Branches:
        """The branches of an episode served before: each turn given is the latest of its branch."""
        branches = cls(next_branch)
        for turn in sorted(heads, key=lambda head: head.branch)[-HEADS_KEPT:]:
            branches._add(_Head(turn.branch, turn.id, _prints(turn.request)))
        return branches

    def locate(self, request: JsonObject) -> Place:
        """Where a call goes: after the head whose messages it extends furthest (the oldest branch of those that
        extend it as far), or on a new branch. The call heads its branch only once `grow` says it was recorded
        (before the next `locate`)."""
        prints = _prints(request)
        for n in sorted((n for n in self._by_length if n < len(prints)), reverse=True):
            extended = [head for head in self._by_length[n] if head.prints == prints[:n]]
            if extended:
                best = min(extended, key=lambda head: head.branch)
                return Place(best.branch, best.turn_id, prints)
        return Place(self._next, None, prints)

    def grow(self, turn_id: str, place: Place) -> None:
        """The turn `locate` placed is recorded: it is the head of its branch now."""
        head = self._heads.get(place.branch)
        if head is None:
            self._add(_Head(place.branch, turn_id, place.prints))
            self._next = max(self._next, place.branch + 1)
            return
        self._unindex(head)
        head.turn_id, head.prints = turn_id, place.prints
        self._by_length.setdefault(len(head.prints), []).append(head)

    def _add(self, head: _Head) -> None:
        self._heads[head.branch] = head
        self._by_length.setdefault(len(head.prints), []).append(head)
        if len(self._heads) > HEADS_KEPT:
            self._unindex(self._heads.pop(next(iter(self._heads))))

    def _unindex(self, head: _Head) -> None:
        same_length = self._by_length[len(head.prints)]
        same_length.remove(head)
        if not same_length:
            del self._by_length[len(head.prints)]


def _prints(request: JsonObject) -> tuple[int, ...]:
    return tuple(_fingerprint(message) for message in request.get("messages") or ())


def _fingerprint(message: Any) -> int:
    if not isinstance(message, dict):
        return hash(repr(message))
    calls = tuple(call.get("id") if isinstance(call, dict) else repr(call) for call in message.get("tool_calls") or ())
    return hash((message.get("role"), text_of(message.get("content")), calls, message.get("tool_call_id")))
