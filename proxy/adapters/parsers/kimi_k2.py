"""Kimi K2's tool calls: `<|tool_calls_section_begin|>` then, per call, `<|tool_call_begin|>functions.NAME:INDEX
<|tool_call_argument_begin|>{args}<|tool_call_end|>`, then `<|tool_calls_section_end|>`."""

from __future__ import annotations

import re
from collections.abc import Sequence

from proxy.adapters.parsers.sections import Section, json_arguments
from proxy.adapters.tool_parsers import FormatParser, ToolCall, _Unparsed
from proxy.core.values import JsonObject

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENTS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
END = "<|im_end|>"
_ID = re.compile(r"\A\s*(?:functions\.)?([^:\s]+)(?::\d+)?\s*\Z")  # functions.NAME:INDEX, the call's id


_SECTION = Section(END, SECTION_BEGIN, SECTION_END, CALL_END)


def _kimi_k2(body: str, tools: Sequence[JsonObject]) -> tuple[str | None, tuple[ToolCall, ...]]:
    return _SECTION.read(body, _call)


def _call(piece: str, where: str) -> ToolCall:
    head, found, arguments = piece.removeprefix(CALL_BEGIN).partition(ARGUMENTS)
    named = _ID.match(head)
    if not piece.startswith(CALL_BEGIN) or not found or named is None:
        raise _Unparsed(f"{where} is not {CALL_BEGIN}functions.NAME:INDEX{ARGUMENTS}{{...}}{CALL_END}")
    return ToolCall(named[1], json_arguments(arguments, where))


KIMI_K2 = FormatParser("kimi_k2", _kimi_k2)
