"""What a model family's entry says (`Family`), and the entry for models no entry covers (`GENERAL`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

# What an entry's `detect` reads: the chat template's text and the tokenizer's vocabulary (its added tokens).
Detect = Callable[[str, Collection[str]], bool]


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # what `policy_options.family` and `served.family` say
    title: str  # the models it covers, in words
    tool_parser: str  # the parser that reads its tool calls (proxy/adapters/parsers)
    reasoning: str | None  # how its reasoning is written, None when it writes none
    end_of_turn: tuple[str, ...]  # the texts of the tokens that end a reply (the first is what the template writes)
    quirks: str  # what its template does that a naive delta would trip on, and how the delta meets it
    detect: Detect = field(repr=False)
    # The model stops on the next turn's role token (GLM): the delta then begins with the id the reply ended on.
    ends_with_next_header: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # chat_template_kwargs it implies
    renderer: str = "jinja"  # who builds its ids: the chat template, or a renderer registered under this name
    verified: bool = True  # checked in CI (tests/test_families.py); False: served through the general delta only


def has(*texts: str) -> Detect:
    """A `detect` that holds when every text is in the chat template or the vocabulary."""
    return lambda template, vocab: all(text in template or text in vocab for text in texts)


GENERAL = Family(
    name="general",
    title="any other model: the general delta, unverified",
    tool_parser="hermes",
    reasoning="<think>…</think> when present",
    end_of_turn=(),
    quirks="No entry says what its template does; the general delta holds wherever the template writes a reply's "
    "end the same whatever follows it, and every turn records `served.family: general`.",
    detect=lambda template, vocab: True,
    verified=False,
)
