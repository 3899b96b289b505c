"""DeepSeek V3.x's tool calls: `<｜tool▁calls▁begin｜>` then, per call, `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{args}
<｜tool▁call▁end｜>` (V3.1 on) or `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and the arguments in a ```json fence
(V3, V3-0324), then `<｜tool▁calls▁end｜>`."""

from __future__ import annotations

import re
from collections.abc import Sequence

from proxy.adapters.parsers.sections import Section, json_arguments
from proxy.adapters.tool_parsers import FormatParser, ToolCall, _Unparsed
from proxy.core.values import JsonObject

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
END = "<｜end▁of▁sentence｜>"
_FENCED = re.compile(r"\A([^\n]+)\n```(?:json)?\n(.*)\n```\s*\Z", re.DOTALL)


_SECTION = Section(END, CALLS_BEGIN, CALLS_END, CALL_END)


def _deepseek_v3(body: str, tools: Sequence[JsonObject]) -> tuple[str | None, tuple[ToolCall, ...]]:
    return _SECTION.read(body, _call)


def _call(piece: str, where: str) -> ToolCall:
    if not piece.startswith(CALL_BEGIN) or SEP not in piece:
        raise _Unparsed(f"{where} is not {CALL_BEGIN}NAME{SEP}ARGUMENTS{CALL_END}")
    name, _, arguments = piece.removeprefix(CALL_BEGIN).partition(SEP)
    if name == "function" and (fenced := _FENCED.match(arguments)):
        name, arguments = fenced[1], fenced[2]
    value = json_arguments(arguments, where)
    if not name.strip():
        raise _Unparsed(f"{where} has no name")
    return ToolCall(name.strip(), value)


DEEPSEEK_V3 = FormatParser("deepseek_v3", _deepseek_v3)
