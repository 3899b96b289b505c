"""What a tool-call parser reads out of an open model's raw sampled text: the values and the parser interface."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.core.values import JsonObject


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI's function.arguments carries it
    id: str | None = None  # the id the model wrote for the call, where its format has one (Mistral's)


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str | None  # the text the agent sees; None when nothing is left besides tool calls and reasoning
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    error: str | None = None  # set when the output did not parse: content is then the whole text, less reasoning


class ToolParser(Protocol):
    """Reads one model family's raw output; `tools` are the request's OpenAI chat tools. The text is a model's, so
    any text: `parse` never raises (what does not parse is a `Parsed` with an `error`), and takes time linear in the
    text's length."""

    @property
    def name(self) -> str: ...  # read-only, so that frozen dataclasses implement it

    def parse(self, text: str, tools: Sequence[JsonObject]) -> Parsed: ...


class NotArguments(Exception):
    """A call's arguments are not a JSON object; the message says what they are instead."""


def arguments_text(value: Any) -> str:
    """A call's arguments as OpenAI's `function.arguments` carries them, a JSON object as text, from the object or
    from the object written as a JSON string."""
    try:
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, dict):
            raise NotArguments("the arguments are not a JSON object")
        return json.dumps(value, ensure_ascii=False)
    # Besides what is not JSON, what JSON raises on a number too long to convert or nesting too deep
    except (ValueError, RecursionError) as e:
        raise NotArguments(f"the arguments are not JSON ({e})") from e
