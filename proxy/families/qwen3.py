"""Qwen3 (2504 and the 2507 instruct and thinking models), with thinking on and off: ChatML turns, hermes tool calls,
`<think>` reasoning that the template keeps only after the last user query."""

from __future__ import annotations

from proxy.families.family import Family, has

_QUIRKS = (
    "The template writes an assistant turn's reasoning (<think>…</think>) only when the turn comes after the last "
    "user query (a user message that is not a <tool_response>), and writes the last assistant turn with an empty "
    "<think></think> block when it has none: a reply is written one way while it is last and another once anything "
    "follows it, so rendering the history again drops what the model sampled. Tool results are grouped into one user "
    "turn. The delta is cut after the reply's <|im_end|> in a rendering that includes the new messages, so neither "
    "rule reaches it."
)
QWEN3 = Family(
    name="qwen3",
    title="Qwen3 with thinking on (the default of Qwen3's hybrid models; Qwen3-Thinking-2507)",
    tool_parser="hermes",
    reasoning="<think>…</think> at the start of the reply",
    end_of_turn=("<|im_end|>",),
    quirks=_QUIRKS,
    detect=has("<|im_start|>", "<think>", "<tool_call>"),
)
QWEN3_NO_THINKING = Family(
    name="qwen3-no-thinking",
    title="Qwen3 with thinking off (chat_template_kwargs enable_thinking: false; Qwen3-Instruct-2507)",
    tool_parser="hermes",
    reasoning=None,
    end_of_turn=("<|im_end|>",),
    quirks=_QUIRKS + " With thinking off, the generation prompt itself ends with an empty <think></think> block, "
    "which is part of the delta and never sampled.",
    detect=has("<|im_start|>", "<think>", "<tool_call>", "enable_thinking"),
    template_kwargs={"enable_thinking": False},
)
