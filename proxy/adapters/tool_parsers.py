"""Tool-call parsers: an open model's raw sampled text read back as an OpenAI chat assistant message.

In tokens mode the inference server returns the text the model sampled, in its family's own tool-call format;
each parser here reads one format (`hermes`, `qwen3_coder`, `llama3_json`) into content, reasoning and tool
calls. Reasoning (`<think>...</think>`) and trailing end-of-turn markers are handled the same for all. Output that
does not parse is never dropped: the message then carries the whole text as content, no tool calls, and a
one-line `error` saying what was wrong. The families with an official renderer have their parsers beside it:
`mistral` (adapters/mistral_tools.py) and gpt-oss's `harmony` (adapters/harmony_template.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from proxy.adapters.harmony_template import HARMONY
from proxy.adapters.mistral_tools import MISTRAL
from proxy.adapters.parsed import Parsed, ToolCall, ToolParser
from proxy.core.values import JsonObject

__all__ = ["PARSERS", "FormatParser", "Parsed", "ToolCall", "ToolParser", "parser"]


class _Unparsed(Exception):
    """The body is not in the parser's format; the message is the one line `Parsed.error` carries."""


# What a format parser makes of the text after reasoning: (content, tool calls), or _Unparsed.
_Body = Callable[[str, Sequence[JsonObject]], tuple[str | None, tuple[ToolCall, ...]]]

# Seen at the end of the text when the server does not skip special tokens.
_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>")
_THINK, _THINK_END = "<think>", "</think>"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)
_UNCLOSED_PARAMETER = re.compile(r"^<parameter=[^>\n]*>", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class FormatParser:
    """A ToolParser made of a name and the reading of its format; reasoning and markers are shared."""

    name: str
    body: _Body

    def parse(self, text: str, tools: Sequence[JsonObject]) -> Parsed:
        reasoning, body = _split_reasoning(_without_end_markers(text))
        if body is None:
            return Parsed(content=None, reasoning=reasoning, tool_calls=())
        try:
            content, calls = self.body(body, tools)
        except _Unparsed as e:
            error = f"{self.name}: " + " ".join(str(e).split())
            return Parsed(content=body.strip() or None, reasoning=reasoning, tool_calls=(), error=error)
        return Parsed(content=content, reasoning=reasoning, tool_calls=calls)


def _without_end_markers(text: str) -> str:
    text = text.rstrip()
    while marker := next((m for m in _END_MARKERS if text.endswith(m)), None):
        text = text.removesuffix(marker).rstrip()
    return text


def _split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning, the rest to parse); the rest is None when the output was cut off while thinking."""
    if _THINK_END in text:
        thought, rest = text.split(_THINK_END, 1)
        return thought.strip().removeprefix(_THINK).strip() or None, rest
    # A <think> later in the text, never closed, is more likely the model writing about the tag than thinking.
    if text.lstrip().startswith(_THINK):
        return text.lstrip().removeprefix(_THINK).strip() or None, None
    return None, text


def _blocks(body: str) -> tuple[str | None, list[tuple[str, bool]]]:
    """The text outside `<tool_call>` blocks, and each block's inside with whether it was closed."""
    outside: list[str] = []
    blocks: list[tuple[str, bool]] = []
    position = 0
    while (start := body.find(_OPEN, position)) != -1:
        outside.append(body[position:start])
        end = body.find(_CLOSE, start)
        if end == -1:  # the closing tag may have been the stop token, and stop tokens are not in the text
            blocks.append((body[start + len(_OPEN) :], False))
            position = len(body)
            break
        blocks.append((body[start + len(_OPEN) : end], True))
        position = end + len(_CLOSE)
    outside.append(body[position:])
    return "\n".join(piece.strip() for piece in outside if piece.strip()) or None, blocks


def _where(number: int, closed: bool) -> str:
    return f"<tool_call> block {number}" + ("" if closed else " (not closed)")


def _arguments(value: Any, where: str) -> str:
    if isinstance(value, str):  # some models write the arguments object as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _Unparsed(f'{where}: "arguments" is a string that is not JSON ({e})') from e
    if not isinstance(value, dict):
        raise _Unparsed(f'{where}: "arguments" is not a JSON object')
    return json.dumps(value, ensure_ascii=False)


def _json_call(call: Any, where: str, keys: tuple[str, ...]) -> ToolCall:
    """A `{"name": ..., <key>: {...}}` object as a ToolCall; the arguments key is the first of `keys` present."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise _Unparsed(f'{where} is not an object with a string "name"')
    key = next((k for k in keys if k in call), None)
    return ToolCall(call["name"], _arguments(call[key] if key else {}, where))


# hermes


def _hermes(body: str, tools: Sequence[JsonObject]) -> tuple[str | None, tuple[ToolCall, ...]]:
    content, blocks = _blocks(body)
    calls: list[ToolCall] = []
    for number, (inside, closed) in enumerate(blocks, 1):
        where = _where(number, closed)
        try:
            call = json.loads(inside)
        except json.JSONDecodeError as e:
            raise _Unparsed(f"{where} is not JSON ({e})") from e
        calls.append(_json_call(call, where, ("arguments", "parameters")))
    return content, tuple(calls)


# qwen3_coder


def _elements(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """Every match of `pattern` in `text`, or None when anything but whitespace lies around or between them."""
    matches = list(pattern.finditer(text))
    edges = [0, *(edge for match in matches for edge in match.span()), len(text)]
    gaps = (text[edges[i] : edges[i + 1]] for i in range(0, len(edges), 2))
    return None if any(gap.strip() for gap in gaps) else matches


def _qwen3_coder(body: str, tools: Sequence[JsonObject]) -> tuple[str | None, tuple[ToolCall, ...]]:
    content, blocks = _blocks(body)
    calls: list[ToolCall] = []
    for number, (inside, closed) in enumerate(blocks, 1):
        where = _where(number, closed)
        functions = _elements(_FUNCTION, inside)
        if not functions:
            raise _Unparsed(f"{where} is not a sequence of <function=NAME>...</function>")
        for function in functions:
            name = function[1].strip()
            parameters = _elements(_PARAMETER, function[2])
            if not name or parameters is None:
                raise _Unparsed(f"{where}: <function={name}> needs a name and only <parameter=NAME>...</parameter>")
            # A missing </parameter> swallows the next parameter; with no escaping in the format, a line opening
            # a <parameter= inside a value is read as that mistake rather than guessed at.
            if any(_UNCLOSED_PARAMETER.search(p[2]) for p in parameters):
                raise _Unparsed(f"{where}: <function={name}>: a <parameter=...> is not closed before the next")
            properties = _properties(tools, name)
            arguments = {p[1].strip(): _typed(_one_newline_off(p[2]), properties.get(p[1].strip())) for p in parameters}
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    return content, tuple(calls)


def _one_newline_off(value: str) -> str:
    return value.removeprefix("\n").removesuffix("\n")


def _properties(tools: Sequence[JsonObject], name: str) -> Mapping[str, Any]:
    """The JSON schema properties of the tool called `name`; empty when the request has no such tool."""
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            return properties if isinstance(properties, dict) else {}
    return {}


_KEEP = object()  # a conversion that did not apply
_JSON_TYPES: Mapping[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def _typed(text: str, schema: Any) -> Any:
    """A parameter's text as its schema's type says; the text itself when no type fits."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        value = _as(kind, text)
        if value is not _KEEP:
            return value
    return text


def _as(kind: Any, text: str) -> Any:
    word = text.strip()
    if kind == "string":
        return text
    if kind == "boolean":
        return {"true": True, "false": False}.get(word.lower(), _KEEP)
    if kind == "null":
        return None if word == "null" else _KEEP
    fits = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
    if fits is None:
        return _KEEP
    try:
        value = json.loads(word)
    except json.JSONDecodeError:
        return _KEEP
    return value if fits(value) else _KEEP


# llama3_json


def _llama3_json(body: str, tools: Sequence[JsonObject]) -> tuple[str | None, tuple[ToolCall, ...]]:
    text = body.strip()
    tagged = text.startswith(_PYTHON_TAG)
    calls_text = text.removeprefix(_PYTHON_TAG).strip()
    if not calls_text.startswith("{"):
        return text or None, ()
    try:
        return None, _json_calls(calls_text)
    except _Unparsed:
        if tagged:
            raise
        return text, ()  # untagged JSON that is not a call is the model answering in JSON


def _json_calls(text: str) -> tuple[ToolCall, ...]:
    """`{...}; {...}` as tool calls; decoded one object at a time, since a ';' may sit inside a string."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    position = 0
    while True:
        where = f"call {len(calls) + 1}"
        try:
            call, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as e:
            raise _Unparsed(f"{where} is not JSON ({e})") from e
        if not isinstance(call, dict) or not ({"parameters", "arguments"} & call.keys()):
            raise _Unparsed(f'{where} is not an object with "name" and "parameters"')
        calls.append(_json_call(call, where, ("parameters", "arguments")))
        rest = text[position:].lstrip()
        if rest.startswith(";") and rest[1:].strip():
            position = len(text) - len(rest[1:].lstrip())
        elif rest in ("", ";"):
            return tuple(calls)
        else:
            raise _Unparsed(f"text after {where} is neither '; {{...}}' nor the end")


PARSERS: Mapping[str, ToolParser] = MappingProxyType(
    {
        parser.name: parser
        for parser in (
            FormatParser("hermes", _hermes),
            FormatParser("qwen3_coder", _qwen3_coder),
            FormatParser("llama3_json", _llama3_json),
            MISTRAL,
            HARMONY,
        )
    }
)


def parser(name: str) -> ToolParser:
    """The parser named by an episode's `policy_options.tool_parser`."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool_parser {name!r}: one of {', '.join(sorted(PARSERS))}") from None
