"""DeepSeek V3, V3.1 and V3.2: `<｜User｜>` / `<｜Assistant｜>` turns, tool calls between `<｜tool▁calls▁begin｜>` and
`<｜tool▁calls▁end｜>`, reasoning opened by the generation prompt's `<think>`."""

from __future__ import annotations

from proxy.families.family import Family, has

DEEPSEEK_V3 = Family(
    name="deepseek-v3",
    title="DeepSeek V3, V3-0324, V3.1 and V3.2 (chat and thinking)",
    tool_parser="deepseek_v3",
    reasoning="the generation prompt ends with <think> (thinking) or </think> (not); the reply's reasoning runs to "
    "</think>",
    end_of_turn=("<｜end▁of▁sentence｜>",),
    quirks="System prompts are gathered at the very start after <｜begin▁of▁sentence｜>; an assistant turn before "
    "the last user message is written '</think>' + content (its reasoning dropped), one after it keeps "
    "'<think>' + reasoning + '</think>'; tool results are <｜tool▁output▁begin｜>…<｜tool▁output▁end｜> with no user "
    "turn around them; the end of sentence token closes every reply. The delta is cut after the reply's "
    "<｜end▁of▁sentence｜>.",
    detect=has("<｜tool▁calls▁begin｜>"),
)
