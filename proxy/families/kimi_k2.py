"""Kimi K2: `<|im_user|>` / `<|im_assistant|>` / `<|im_system|>` turns closed by `<|im_end|>`, tool calls in a
`<|tool_calls_section_begin|>` section with ids `functions.NAME:INDEX`."""

from __future__ import annotations

from proxy.families.family import Family, has

KIMI_K2 = Family(
    name="kimi-k2",
    title="Kimi K2 (Instruct 0711 and 0905)",
    tool_parser="kimi_k2",
    reasoning=None,
    end_of_turn=("<|im_end|>",),
    quirks="A default system prompt is written when there is none; the tools are declared in a system turn of their "
    "own (tool_declare); a tool call's id is functions.NAME:INDEX and a tool result is a system turn that names the "
    "call it answers ('## Return of ID'), so the result follows the id the agent hands back. The delta is cut after "
    "the reply's <|im_end|>.",
    detect=has("<|tool_calls_section_begin|>"),
)
