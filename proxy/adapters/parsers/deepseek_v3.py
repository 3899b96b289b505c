"""DeepSeek V3.x's tool calls: `<｜tool▁calls▁begin｜>` then, per call, `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{args}
<｜tool▁call▁end｜>` (V3.1 on) or `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and the arguments in a ```json fence
(V3, V3-0324), then `<｜tool▁calls▁end｜>`."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from proxy.adapters.tool_parsers import FormatParser, ToolCall, _arguments, _Unparsed
from proxy.core.values import JsonObject

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
END = "<｜end▁of▁sentence｜>"
_FENCED = re.compile(r"\A([^\n]+)\n```(?:json)?\n(.*)\n```\s*\Z", re.DOTALL)


def _deepseek_v3(body: str, tools: Sequence[JsonObject]) -> tuple[str | None, tuple[ToolCall, ...]]:
    body = body.strip().removesuffix(END).rstrip()
    content, found, section = body.partition(CALLS_BEGIN)
    if not found:
        return content.strip() or None, ()
    section = section.strip().removesuffix(CALLS_END)
    calls: list[ToolCall] = []
    for number, piece in enumerate(section.split(CALL_END), 1):
        piece = piece.strip()
        if not piece:
            continue
        where = f"tool call {number}"
        if not piece.startswith(CALL_BEGIN) or SEP not in piece:
            raise _Unparsed(f"{where} is not {CALL_BEGIN}NAME{SEP}ARGUMENTS{CALL_END}")
        name, _, arguments = piece.removeprefix(CALL_BEGIN).partition(SEP)
        if name == "function" and (fenced := _FENCED.match(arguments)):
            name, arguments = fenced[1], fenced[2]
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise _Unparsed(f"{where}: its arguments are not JSON ({e})") from e
        if not name.strip():
            raise _Unparsed(f"{where} has no name")
        calls.append(ToolCall(name.strip(), _arguments(value, where)))
    return content.strip() or None, tuple(calls)


DEEPSEEK_V3 = FormatParser("deepseek_v3", _deepseek_v3)
