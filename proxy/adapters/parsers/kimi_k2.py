"""Kimi K2's tool calls: `<|tool_calls_section_begin|>` then, per call, `<|tool_call_begin|>functions.NAME:INDEX
<|tool_call_argument_begin|>{args}<|tool_call_end|>`, then `<|tool_calls_section_end|>`."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from proxy.adapters.tool_parsers import FormatParser, ToolCall, _arguments, _Unparsed
from proxy.core.values import JsonObject

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENTS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
END = "<|im_end|>"
_ID = re.compile(r"\A\s*(?:functions\.)?([^:\s]+)(?::\d+)?\s*\Z")  # functions.NAME:INDEX, the call's id


def _kimi_k2(body: str, tools: Sequence[JsonObject]) -> tuple[str | None, tuple[ToolCall, ...]]:
    body = body.strip().removesuffix(END).rstrip()
    content, found, section = body.partition(SECTION_BEGIN)
    if not found:
        return content.strip() or None, ()
    section = section.strip().removesuffix(SECTION_END)
    calls: list[ToolCall] = []
    for number, piece in enumerate(section.split(CALL_END), 1):
        piece = piece.strip()
        if not piece:
            continue
        where = f"tool call {number}"
        head, found, arguments = piece.removeprefix(CALL_BEGIN).partition(ARGUMENTS)
        named = _ID.match(head)
        if not piece.startswith(CALL_BEGIN) or not found or named is None:
            raise _Unparsed(f"{where} is not {CALL_BEGIN}functions.NAME:INDEX{ARGUMENTS}{{...}}{CALL_END}")
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise _Unparsed(f"{where}: its arguments are not JSON ({e})") from e
        calls.append(ToolCall(named[1], _arguments(value, where)))
    return content.strip() or None, tuple(calls)


KIMI_K2 = FormatParser("kimi_k2", _kimi_k2)
