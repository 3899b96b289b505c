"""Qwen3-Coder and Qwen3.5: ChatML turns whose tool calls are XML (`<function=NAME><parameter=KEY>…`), read by the
`qwen3_coder` parser; Qwen3.5 also thinks in `<think>`."""

from __future__ import annotations

from proxy.families.family import Family

QWEN3_CODER = Family(
    name="qwen3-coder",
    title="Qwen3-Coder (30B-A3B, 480B-A35B)",
    tool_parser="qwen3_coder",
    reasoning=None,
    end_of_turn=("<|im_end|>",),
    quirks="Tool calls are <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>, each "
    "value written as text (a string as it is, others as JSON), so an agent's arguments come back re-serialised; "
    "tool results are grouped into one user turn; a default system prompt is written when there is none. The delta "
    "is cut after the reply's <|im_end|>.",
    detect=lambda template, _: "<function=" in template and "<|im_start|>" in template and "<think>" not in template,
)
QWEN35 = Family(
    name="qwen3.5",
    title="Qwen3.5 (and Qwen3-Next with XML tool calls)",
    tool_parser="qwen3_coder",
    reasoning="<think>…</think> at the start of the reply",
    end_of_turn=("<|im_end|>",),
    quirks="Qwen3-Coder's XML tool calls with Qwen3's reasoning rule: reasoning is written only after the last user "
    "query, so the history is written differently from what was sampled. The delta is cut after the reply's "
    "<|im_end|>.",
    detect=lambda template, vocab: "<function=" in template and "<think>" in template and "<|im_start|>" in template,
)
