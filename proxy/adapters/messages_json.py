"""A chat-mode call's body for its server, written as its parent's messages' text and the new messages' JSON: the
conversation's messages are dumped once, when the episode's first call sends them, not again on every turn.

A call whose request holds its parent's message objects (the same objects, in the same places: a body read against
its episode's latest, `proxy/http/prefix.py`, keeps them) and more after them is sent with the text of the parent's
messages as its parent's body holds it and the new messages dumped after it, in pieces: the body is sent as they are
(`proxy/adapters/sent_body.py`), and the conversation's text copied only when its pieces grow many (`compacted`). A
message object is never changed once a call has been sent with it (an argument restored is restored on a copy:
`proxy/core/branches.py`), so its text is its value's. Any other call's messages are dumped whole, as before; either
way the bytes are those `orjson.dumps` writes for the whole body. A call's text is kept for its children, and its
parent's let go once it is (a chain holds its latest call's alone: `proxy/adapters/ids_json.py` says why).
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.adapters.ids_json import Pieces, chained, compacted, held_bytes, pieces
from proxy.core.values import JsonObject

_KEPT_BYTES = 64 << 20  # the messages' text kept for calls' children, all episodes together
_PLACE = [-(1 << 62) - 49]  # where the messages go in the body, as their JSON text
_PLACED = orjson.dumps(_PLACE)


@dataclass(frozen=True, slots=True)
class _Kept:
    messages: list[Any]  # the list sent (held, so that its id is not another's)
    sent: tuple[Any, ...]  # the message objects it held when sent, whose text `text` is
    text: Pieces

    @property
    def size(self) -> int:
        return held_bytes(self.text)


class MessagesJson:
    """The JSON text of the latest calls' messages, by the list holding them, for their children's bodies."""

    def __init__(self, kept_bytes: int = _KEPT_BYTES) -> None:
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._bytes = 0
        self._limit = kept_bytes

    def body(self, body: JsonObject, earlier: Sequence[Any] | None) -> Pieces:
        """`orjson.dumps(body)` in pieces, its `messages` written from those of `earlier` (the parent's), where it
        begins with them; the messages' text kept for the call's children."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            return (orjson.dumps(body),)
        dumped = orjson.dumps({**body, "messages": _PLACE})
        at = dumped.find(_PLACED)
        if at < 0 or dumped.find(_PLACED, at + 1) >= 0:  # the placeholder's text elsewhere too: dumped whole
            return (orjson.dumps(body),)
        text = compacted(self._text(messages, earlier))
        self._keep(messages, text, earlier)
        whole = memoryview(dumped)
        return (whole[:at], *text, whole[at + len(_PLACED) :])

    def _text(self, messages: list[Any], earlier: Sequence[Any] | None) -> Pieces:
        kept = self._kept.get(id(earlier)) if earlier is not None else None
        if kept is None or kept.messages is not earlier:
            return pieces(orjson.dumps(messages))
        n = len(kept.sent)
        # the same objects, compared by identity in C (a reference a message)
        if n > len(messages) or not all(map(operator.is_, kept.sent, messages)):
            return pieces(orjson.dumps(messages))
        self._kept.move_to_end(id(earlier))
        return chained(kept.text, pieces(orjson.dumps(messages[n:])))

    def _keep(self, messages: list[Any], text: Pieces, earlier: Sequence[Any] | None) -> None:
        for key in (id(messages), id(earlier)):
            if (before := self._kept.pop(key, None)) is not None:
                self._bytes -= before.size
        kept = self._kept[id(messages)] = _Kept(messages, tuple(messages), text)
        self._bytes += kept.size
        while self._bytes > self._limit and self._kept:
            _, gone = self._kept.popitem(last=False)
            self._bytes -= gone.size
