"""Llama 3.1, 3.2 and 3.3: header-delimited turns, JSON tool calls (`{"name": …, "parameters": …}`), built-in tools
after `<|python_tag|>` ending in `<|eom_id|>`."""

from __future__ import annotations

from proxy.families.family import Family, has

LLAMA3 = Family(
    name="llama3",
    title="Llama 3.1, 3.2 and 3.3 instruct",
    tool_parser="llama3_json",
    reasoning=None,
    end_of_turn=("<|eot_id|>", "<|eom_id|>"),
    quirks="Every conversation opens with a system turn holding the knowledge cut-off and today's date, whether or "
    "not one was given; the tools are written into the first user message (tools_in_user_message, the default); a "
    "tool call is a JSON object as the whole reply (the template refuses more than one per message; the model may "
    "write several separated by ';'); tool results are turns of the ipython role; a call of a built-in tool follows "
    "<|python_tag|> and ends with <|eom_id|>, which ends the reply as <|eot_id|> does. The delta is cut after the "
    "reply's end, so neither the dates nor the tools enter it.",
    detect=has("<|start_header_id|>", "<|eot_id|>"),
)
