"""Mistral's models through `mistral-common`, their official tokenizer and renderer (adapters/mistral_template.py)."""

from __future__ import annotations

from proxy.families.family import Family, has

MISTRAL = Family(
    name="mistral",
    title="Mistral's instruct models (Mistral Small and Large, Magistral, Devstral, Ministral) with a tekken tokenizer",
    tool_parser="mistral",
    reasoning="[THINK]…[/THINK] (Magistral)",
    end_of_turn=("</s>",),
    quirks="Rendered by mistral-common rather than a template: the system prompt goes into the last user message and "
    "the tools just before it, so a whole rendering moves them as the conversation grows; the delta renders the new "
    "messages after the reply they follow (tests/test_mistral_template.py).",
    detect=has("[TOOL_CALLS]", "[INST]"),
    renderer="mistral",
)
