"""GLM-4.5, 4.6 and 4.7: `<|user|>` / `<|assistant|>` / `<|observation|>` turns with no end-of-turn token, tool calls
as `<tool_call>NAME<arg_key>…</arg_key><arg_value>…</arg_value></tool_call>`, `<think>` reasoning."""

from __future__ import annotations

from proxy.families.family import Family, has

GLM45 = Family(
    name="glm4.5",
    title="GLM-4.5, GLM-4.6, GLM-4.7 (and GLM-4.5-Air)",
    tool_parser="glm45",
    reasoning="<think>…</think> at the start of the reply",
    end_of_turn=("<|user|>", "<|observation|>"),
    quirks="No token closes a turn: the model stops by writing the next turn's role token (<|observation|> before "
    "tool results, <|user|> otherwise), so the ids a reply ended on are the first of the delta, which begins right "
    "after the reply's text; a reply that stopped on the role the new messages do not open cannot be continued (a "
    "discontinuity). Reasoning is kept only after the last user message (earlier turns get an empty "
    "<think></think>); consecutive tool results share one <|observation|> turn.",
    detect=has("<arg_key>", "<|observation|>"),
    ends_with_next_header=True,
)
