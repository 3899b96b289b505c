"""Renderer: what token in, token out needs of a model family's prompt writer, whether a chat template or a family's
official renderer (adapters/mistral_template.py, adapters/harmony_template.py).

A call that continues its parent turn is prompted with the parent's prompt ids, the ids the parent sampled, and
`delta(new, ...)`: what the renderer writes for the new messages after a reply. Any other call is `prompt(...)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from proxy.core.values import JsonObject


class Renderer(Protocol):
    """A model family's prompt writer and tokenizer. `end_of_turn` is the id a whole reply ends with; `stops` every
    id a reply may end with (gpt-oss ends a tool call with another id than an answer): a reply whose last sampled id
    is in `stops` has `ended`."""

    @property
    def end_of_turn(self) -> int: ...

    @property
    def stops(self) -> frozenset[int]: ...

    def prompt(self, messages: Sequence[JsonObject], tools: Sequence[JsonObject] | None) -> list[int]:
        """The ids of a whole conversation, rendered for the model to reply to."""
        ...

    def delta(
        self,
        new: Sequence[JsonObject],
        tools: Sequence[JsonObject] | None,
        ended: bool,
        history: Sequence[JsonObject] = (),
    ) -> list[int] | None:
        """The ids written for `new` messages after a reply, up to the next reply's start; None if the renderer cannot
        say. `history`, the messages up to and with that reply, is read only for what the new messages' rendering
        depends on (a system prompt written into the last user message, the names of the tools called)."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...
