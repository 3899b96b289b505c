"""gpt-oss through `openai-harmony`, its official renderer (adapters/harmony_template.py)."""

from __future__ import annotations

from proxy.families.family import Family, has

GPT_OSS = Family(
    name="gpt-oss",
    title="gpt-oss-20b and gpt-oss-120b (the harmony format)",
    tool_parser="harmony",
    reasoning="the analysis channel",
    end_of_turn=("<|return|>", "<|call|>"),
    quirks="Rendered by openai-harmony rather than a template: replies are channels (analysis, commentary, final); an "
    "answer ends with <|return|>, a tool call with <|call|>, and a rendering of history writes <|end|> and drops "
    "earlier analysis; the delta renders the new messages after the reply as sampled "
    "(tests/test_harmony_template.py).",
    detect=has("<|channel|>", "<|call|>"),
    renderer="harmony",
)
