"""GLM-4.5 and later's tool calls: `<tool_call>NAME` then, per argument, `<arg_key>KEY</arg_key>` and
`<arg_value>VALUE</arg_value>` (a string as it is, any other value as JSON), then `</tool_call>`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from proxy.adapters.tool_parsers import (
    FormatParser,
    ToolCall,
    _after_space,
    _blocks,
    _properties,
    _typed,
    _Unparsed,
    _where,
)
from proxy.core.values import JsonObject

_ENDS = ("<|user|>", "<|observation|>", "<|endoftext|>")  # GLM stops on the next turn's role token
_KEY, _KEY_END, _VALUE, _VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


def _glm45(body: str, tools: Sequence[JsonObject]) -> tuple[str | None, tuple[ToolCall, ...]]:
    body = body.rstrip()
    while end := next((e for e in _ENDS if body.endswith(e)), None):
        body = body.removesuffix(end).rstrip()
    content, blocks = _blocks(body)
    calls: list[ToolCall] = []
    schemas = _properties(tools)
    for number, (inside, closed) in enumerate(blocks, 1):
        where = _where(number, closed)
        start = inside.find(_KEY)
        name = inside[: len(inside) if start == -1 else start]
        pairs = _pairs(inside, len(name))
        if not name.strip() or pairs is None:
            raise _Unparsed(f"{where} is not NAME then <arg_key>KEY</arg_key><arg_value>VALUE</arg_value> pairs")
        properties = schemas.get(name.strip(), {})
        arguments = {key.strip(): _value(value, properties.get(key.strip())) for key, value in pairs}
        calls.append(ToolCall(name.strip(), json.dumps(arguments, ensure_ascii=False)))
    return content, tuple(calls)


def _pairs(text: str, position: int) -> list[tuple[str, str]] | None:
    """Each `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` from `position` on, or None when anything but
    whitespace lies around or between them. One pass: each search starts where the one before ended, so that a tag
    never closed costs one scan of the text, not one per tag opened after it."""
    pairs: list[tuple[str, str]] = []
    position = _after_space(text, position)
    while position < len(text):
        key_end = text.find(_KEY_END, position) if text.startswith(_KEY, position) else -1
        value_at = _after_space(text, key_end + len(_KEY_END)) if key_end != -1 else -1
        value_end = text.find(_VALUE_END, value_at) if value_at != -1 and text.startswith(_VALUE, value_at) else -1
        if value_end == -1:
            return None
        pairs.append((text[position + len(_KEY) : key_end], text[value_at + len(_VALUE) : value_end]))
        position = _after_space(text, value_end + len(_VALUE_END))
    return pairs


def _value(text: str, schema: Any) -> Any:
    """A value as its schema's type says; with no type to go by, JSON if it reads as JSON (as GLM writes every
    value but a string), else the text."""
    if isinstance(schema, dict) and "type" in schema:
        return _typed(text, schema)
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, a number too long to convert, or nested too deep
        return text


GLM45 = FormatParser("glm45", _glm45)
