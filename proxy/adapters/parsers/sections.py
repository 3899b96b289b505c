"""Tool calls written as one section of delimited calls (DeepSeek V3's and Kimi K2's): the text before the section
is the content, each call between the section's markers is read by its format's own reader."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from proxy.adapters.tool_parsers import ToolCall, _arguments, _Unparsed

# (one call's text, "tool call N") -> the call, or _Unparsed saying why not
CallReader = Callable[[str, str], ToolCall]


@dataclass(frozen=True, slots=True)
class Section:
    """A format's markers: the reply's end, the section's begin and end, and what ends each call."""

    end: str
    begin: str
    close: str
    call_end: str

    def read(self, body: str, call: CallReader) -> tuple[str | None, tuple[ToolCall, ...]]:
        body = body.strip().removesuffix(self.end).rstrip()
        content, found, section = body.partition(self.begin)
        if not found:
            return content.strip() or None, ()
        section = section.strip().removesuffix(self.close)
        calls = [
            call(piece.strip(), f"tool call {number}")
            for number, piece in enumerate(section.split(self.call_end), 1)
            if piece.strip()
        ]
        return content.strip() or None, tuple(calls)


def json_arguments(arguments: str, where: str) -> str:
    """A call's arguments, which must be a JSON object, as OpenAI's `function.arguments` carries them."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as e:
        raise _Unparsed(f"{where}: its arguments are not JSON ({e})") from e
    return _arguments(value, where)
