"""Branches: which conversation a call continues, the branches of an episode's trajectory.

An agent's calls usually extend one conversation: each request repeats the previous one's messages and adds
the reply and what followed. A request that does not (the agent compacted its context, started a sub-agent,
or asked a side question) opens a new branch. Messages are compared by role, text and tool-call ids only, so
markers agents move between calls (Anthropic's `cache_control`) and re-serialised tool arguments do not
break a conversation in two.

Where a turn's reply came with the token ids its policy sampled, a call continues that turn only if it hands the
reply back as it was given: the same text and the same tool calls (names, and arguments as JSON values); the
reasoning an agent drops from its history does not count. A call that rewrote the reply opens a new branch: the
ids sampled are not what its history says.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from proxy.core.values import Extension, JsonObject, Reply, Turn, text_of

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
    reply: JsonObject | None = None  # the head's reply, where it carried sampled ids: a call must hand it back


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
            branches._add(_Head(turn.branch, turn.id, _prints(turn.request), _sampled(turn.reply)))
        return branches

    def locate(self, request: JsonObject, extension: Extension | None = None) -> Place:
        """Where a call goes: after the head whose messages it extends furthest (the oldest branch of those that
        extend it as far), or on a new branch. The call heads its branch only once `grow` says it was recorded
        (before the next `locate`). A call that extends a head's messages (`extension`) has only its new messages
        printed."""
        messages = request.get("messages") or ()
        prints = self._known_prints(messages, extension) or _prints(request)
        for n in sorted((n for n in self._by_length if n < len(prints)), reverse=True):
            extended = [
                head
                for head in self._by_length[n]
                if head.prints == prints[:n] and (head.reply is None or same_message(head.reply, messages[n]))
            ]
            if extended:
                best = min(extended, key=lambda head: head.branch)
                return Place(best.branch, best.turn_id, prints)
        return Place(self._next, None, prints)

    def _known_prints(self, messages: Any, extension: Extension | None) -> tuple[int, ...] | None:
        if extension is None:
            return None
        for head in self._heads.values():
            if head.turn_id == extension.turn_id and len(head.prints) == extension.messages:
                return head.prints + tuple(_fingerprint(message) for message in messages[extension.messages :])
        return None

    def grow(self, turn_id: str, place: Place) -> None:
        """The turn `locate` placed is recorded: it is the head of its branch now."""
        head = self._heads.get(place.branch)
        if head is None:
            self._add(_Head(place.branch, turn_id, place.prints))
            self._next = max(self._next, place.branch + 1)
            return
        self._unindex(head)
        head.turn_id, head.prints, head.reply = turn_id, place.prints, None
        self._by_length.setdefault(len(head.prints), []).append(head)

    def answered(self, turn_id: str, reply: Reply) -> None:
        """A turn was answered: if it heads its branch and its reply carries sampled ids, the branch goes on only
        through calls that hand that reply back."""
        message = _sampled(reply)
        if message is None:
            return
        for head in self._heads.values():
            if head.turn_id == turn_id:
                head.reply = message
                return

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


def same_message(given: JsonObject, echoed: Any) -> bool:
    """Whether a message an agent sends back says what the reply it was given said: the same text (less the
    whitespace around it) and the same tool calls, by name and arguments as JSON values (agents re-serialise
    arguments, and drop reasoning and the ids of calls in some dialects)."""
    if not isinstance(echoed, dict) or echoed.get("role") != "assistant":
        return False
    if text_of(given.get("content")).strip() != text_of(echoed.get("content")).strip():
        return False
    return _calls(given) == _calls(echoed)


def _calls(message: JsonObject) -> list[tuple[Any, Any]] | None:
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            return None
        arguments = function.get("arguments")
        try:
            value = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            value = arguments
        calls.append((function.get("name"), value))
    return calls


def _sampled(reply: Reply | None) -> JsonObject | None:
    """The reply's message, where the reply carries the ids its policy sampled."""
    if reply is None or reply.completion_token_ids is None or reply.message is None:
        return None
    return reply.message


def _prints(request: JsonObject) -> tuple[int, ...]:
    return tuple(_fingerprint(message) for message in request.get("messages") or ())


def _fingerprint(message: Any) -> int:
    if not isinstance(message, dict):
        return hash(repr(message))
    calls = tuple(call.get("id") if isinstance(call, dict) else repr(call) for call in message.get("tool_calls") or ())
    return hash((message.get("role"), text_of(message.get("content")), calls, message.get("tool_call_id")))
