"""ChatML, as Qwen2.5 writes it: `<|im_start|>ROLE\n…<|im_end|>` turns, hermes tool calls."""

from __future__ import annotations

from proxy.families.family import Family, has

CHATML = Family(
    name="chatml",
    title="ChatML models, Qwen2 and Qwen2.5 (instruct and coder)",
    tool_parser="hermes",
    reasoning=None,
    end_of_turn=("<|im_end|>",),
    quirks="A default system prompt is written when the conversation has none (Qwen2.5's 'You are Qwen...'); the "
    "tools are listed in the system turn; tool results are grouped into one user turn of <tool_response> blocks. The "
    "delta is cut after the reply's <|im_end|>, so the system turn and the tools never enter it.",
    detect=has("<|im_start|>"),
)
