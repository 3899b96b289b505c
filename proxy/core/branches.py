"""Which conversation a call continues: the branches of an episode's trajectory.

An agent's calls usually extend one conversation: each request repeats the previous one's messages and adds
the reply and what followed. A request that does not (the agent compacted its context, started a sub-agent,
or asked a side question) opens a new branch. Messages are compared by role, text and tool-call ids only, so
markers agents move between calls (Anthropic's `cache_control`) and re-serialised tool arguments do not
break a conversation in two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.core.values import JsonObject, text_of

_HEADS_KEPT = 64


@dataclass(slots=True)
class _Head:
    branch: int
    turn_id: str
    prints: list[int]


class Branches:
    """The latest call of each branch of one episode."""

    def __init__(self, next_branch: int = 0) -> None:
        self._heads: list[_Head] = []
        self._next = next_branch

    def place(self, turn_id: str, request: JsonObject) -> tuple[int, str | None]:
        """The branch a new call belongs to and the turn it extends (None when it opens a branch)."""
        prints = [_fingerprint(message) for message in request.get("messages") or ()]
        best: _Head | None = None
        for head in self._heads:
            n = len(head.prints)
            if n < len(prints) and prints[:n] == head.prints and (best is None or n > len(best.prints)):
                best = head
        if best is None:
            best = _Head(self._next, turn_id, prints)
            self._next += 1
            self._heads.append(best)
            if len(self._heads) > _HEADS_KEPT:
                self._heads.pop(0)
            return best.branch, None
        parent = best.turn_id
        best.turn_id, best.prints = turn_id, prints
        return best.branch, parent


def _fingerprint(message: Any) -> int:
    if not isinstance(message, dict):
        return hash(repr(message))
    calls = tuple(call.get("id") if isinstance(call, dict) else repr(call) for call in message.get("tool_calls") or ())
    return hash((message.get("role"), text_of(message.get("content")), calls, message.get("tool_call_id")))
