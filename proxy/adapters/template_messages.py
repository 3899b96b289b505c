"""A call's messages as chat templates take them, each shaped when it is first read: a continued turn in token in,
token out reads only its parent's reply and the messages after it, and shapes only those."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

from proxy.core.values import JsonObject, text_of

_FIELDS = ("role", "tool_calls", "tool_call_id", "name", "reasoning_content")


def template_message(message: JsonObject) -> JsonObject:
    """A message as chat templates take it: text content, and the fields templates read."""
    shaped: JsonObject = {k: message[k] for k in _FIELDS if k in message}
    content = message.get("content")
    shaped["content"] = content if content is None or isinstance(content, str) else text_of(content)
    return shaped


class TemplateMessages(Sequence[JsonObject]):
    """The messages (objects only) of a request, shaped for templates as they are read, each once."""

    __slots__ = ("_given", "_shaped")

    def __init__(self, given: Sequence[Any], *, shaped: bool = False) -> None:
        """`given`: a request's messages; or, `shaped`, messages shaped already (taken as they are)."""
        self._given = [m for m in given if isinstance(m, dict)]
        self._shaped: list[JsonObject | None] = list(self._given) if shaped else [None] * len(self._given)

    def __len__(self) -> int:
        return len(self._given)

    @overload
    def __getitem__(self, index: int) -> JsonObject: ...

    @overload
    def __getitem__(self, index: slice) -> list[JsonObject]: ...

    def __getitem__(self, index: int | slice) -> JsonObject | list[JsonObject]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self._given)))]
        shaped = self._shaped[index]
        if shaped is None:
            shaped = self._shaped[index] = template_message(self._given[index])
        return shaped

    def __iter__(self) -> Iterator[JsonObject]:
        return (self[i] for i in range(len(self._given)))

    def head(self, n: int) -> TemplateMessages:
        """The first `n` messages, shaped as they are read."""
        head = TemplateMessages(())
        head._given, head._shaped = self._given[:n], self._shaped[:n]
        return head

    def all(self) -> list[JsonObject]:
        """Every message, shaped (for a rendering of the whole conversation)."""
        return self[:]
