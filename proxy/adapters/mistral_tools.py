"""The `mistral` tool parser: a Mistral model's raw sampled text (special tokens kept) read back as a reply.

Mistral models write their calls after `[TOOL_CALLS]`: up to tokenizer v7 one JSON list of
`{"name", "arguments", "id"}` objects, from v11 one `[TOOL_CALLS]name[ARGS]{...}` per call (`name[CALL_ID]id[ARGS]`
in v11 with ids). Text before the first `[TOOL_CALLS]` is content; reasoning opens the reply, in `[THINK]...[/THINK]`
(v13 on) or in the plain-text `<think>...</think>` of earlier Magistral models; a trailing `</s>` is dropped. The id a
model wrote for a call is kept (`ToolCall.id`), so that the result the agent sends back is written with it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.adapters.parsed import NotArguments, Parsed, ToolCall, arguments_text
from proxy.core.values import JsonObject

_CALLS, _ARGS, _CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_END = "</s>"
_THINKING = (("[THINK]", "[/THINK]"), ("<think>", "</think>"))


class _Unparsed(Exception):
    """Not Mistral's format; the message is the one line `Parsed.error` carries."""


@dataclass(frozen=True, slots=True)
class MistralParser:
    name: str = "mistral"

    def parse(self, text: str, tools: Sequence[JsonObject]) -> Parsed:
        reasoning, body = _reasoning(_without_end(text))
        if body is None:
            return Parsed(content=None, reasoning=reasoning, tool_calls=())
        content, *blocks = body.split(_CALLS)
        try:
            calls = tuple(call for number, block in enumerate(blocks, 1) for call in _block(block, number))
        # Besides _Unparsed, what JSON raises on a number too long or nesting too deep: text with an error too
        except (_Unparsed, ValueError, RecursionError) as e:
            return Parsed(body.strip() or None, reasoning, (), error=f"{self.name}: " + " ".join(str(e).split()))
        return Parsed(content.strip() or None, reasoning, calls)


MISTRAL = MistralParser()


def _without_end(text: str) -> str:
    """The text less the `</s>` and whitespace that trail it; by index, as a cut copy per marker would cost the whole
    text again for each of thousands."""
    end = len(text.rstrip())
    while text.endswith(_END, 0, end):
        end -= len(_END)
        while end and text[end - 1].isspace():
            end -= 1
    return text[:end]


def _reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning, the rest to parse); the rest is None when the reply was cut off while thinking."""
    opened = text.lstrip()
    for start, end in _THINKING:
        if opened.startswith(start):
            thought, closed, rest = opened.removeprefix(start).partition(end)
            return thought.strip() or None, rest if closed else None
    return None, text


def _block(block: str, number: int) -> list[ToolCall]:
    """The calls after one `[TOOL_CALLS]`."""
    where = f"[TOOL_CALLS] {number}"
    if block.lstrip().startswith(("[", "{")):
        return _json_calls(block, where)
    head, marked, arguments = block.partition(_ARGS)
    if not marked:
        raise _Unparsed(f"{where} is neither a JSON list of calls nor NAME[ARGS]{{...}}")
    name, _, call_id = head.partition(_CALL_ID)
    if not name.strip():
        raise _Unparsed(f"{where} has no function name before [ARGS]")
    return [ToolCall(name.strip(), _arguments(arguments, where), call_id.strip() or None)]


def _json_calls(block: str, where: str) -> list[ToolCall]:
    try:
        value, end = json.JSONDecoder().raw_decode(block.strip())
    except json.JSONDecodeError as e:
        raise _Unparsed(f"{where} is not JSON ({e})") from e
    if block.strip()[end:].strip():
        raise _Unparsed(f"{where}: text follows the JSON calls")
    calls = []
    for n, call in enumerate(value if isinstance(value, list) else [value], 1):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            raise _Unparsed(f'{where}, call {n}, is not an object with a string "name"')
        call_id = call.get("id")
        arguments = _arguments(call.get("arguments", {}), f"{where}, call {n}")
        calls.append(ToolCall(call["name"], arguments, call_id if isinstance(call_id, str) and call_id else None))
    return calls


def _arguments(value: Any, where: str) -> str:
    try:
        return arguments_text(value)
    except NotArguments as e:
        raise _Unparsed(f"{where}: {e}") from e
