"""Every tool-call parser by name: those of `proxy/adapters/tool_parsers.py` (hermes, qwen3_coder, llama3_json) and
the formats in modules of their own here (deepseek_v3, glm45, kimi_k2), each built on its `FormatParser`.

They are gathered here rather than in `tool_parsers.PARSERS` because these modules build on that one: registered
there, the two would import each other."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from proxy.adapters.parsers.deepseek_v3 import DEEPSEEK_V3
from proxy.adapters.parsers.glm45 import GLM45
from proxy.adapters.parsers.kimi_k2 import KIMI_K2
from proxy.adapters.tool_parsers import PARSERS as FIRST
from proxy.adapters.tool_parsers import ToolParser

PARSERS: Mapping[str, ToolParser] = MappingProxyType(
    {**FIRST, **{each.name: each for each in (DEEPSEEK_V3, GLM45, KIMI_K2)}}
)


def parser(name: str) -> ToolParser:
    """The parser named by an episode's `policy_options.tool_parser` (or its family's)."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool_parser {name!r}: one of {', '.join(sorted(PARSERS))}") from None
