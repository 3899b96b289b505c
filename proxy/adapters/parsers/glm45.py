"""GLM-4.5 and later's tool calls: `<tool_call>NAME` then, per argument, `<arg_key>KEY</arg_key>` and
`<arg_value>VALUE</arg_value>` (a string as it is, any other value as JSON), then `</tool_call>`."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from proxy.adapters.tool_parsers import FormatParser, ToolCall, _blocks, _properties, _typed, _Unparsed, _where
from proxy.core.values import JsonObject

_ENDS = ("<|user|>", "<|observation|>", "<|endoftext|>")  # GLM stops on the next turn's role token
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm45(body: str, tools: Sequence[JsonObject]) -> tuple[str | None, tuple[ToolCall, ...]]:
    body = body.rstrip()
    while end := next((e for e in _ENDS if body.endswith(e)), None):
        body = body.removesuffix(end).rstrip()
    content, blocks = _blocks(body)
    calls: list[ToolCall] = []
    schemas = _properties(tools)
    for number, (inside, closed) in enumerate(blocks, 1):
        where = _where(number, closed)
        name, _, pairs = inside.partition("<arg_key>")
        pairs = "<arg_key>" + pairs if pairs else ""
        if not name.strip() or _PAIR.sub("", pairs).strip():
            raise _Unparsed(f"{where} is not NAME then <arg_key>KEY</arg_key><arg_value>VALUE</arg_value> pairs")
        properties = schemas.get(name.strip(), {})
        arguments = {key.strip(): _value(value, properties.get(key.strip())) for key, value in _PAIR.findall(pairs)}
        calls.append(ToolCall(name.strip(), json.dumps(arguments, ensure_ascii=False)))
    return content, tuple(calls)


def _value(text: str, schema: Any) -> Any:
    """A value as its schema's type says; with no type to go by, JSON if it reads as JSON (as GLM writes every
    value but a string), else the text."""
    if isinstance(schema, dict) and "type" in schema:
        return _typed(text, schema)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


GLM45 = FormatParser("glm45", _glm45)
