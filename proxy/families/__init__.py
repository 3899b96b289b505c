"""Model families: each a named, documented entry saying how a family's chat template, tool calls and reasoning are
written, so that token in, token out knows what to expect of it (`policy_options.family`).

One small file per family. An entry names its tool-call parser (`proxy/adapters/parsers/`), its reasoning format,
the texts of the tokens that end its replies, the quirks of its template that matter to an append-only delta (in
words, for the docs), how it is recognised from the tokenizer, and the renderer that builds its ids: `jinja` (the
tokenizer's own chat template, `proxy/adapters/chat_templates.py`) or another registered there under the name the
entry gives (a family whose official renderer is a package, not a template). Adding a family is adding a file
here and its name to `FAMILIES`; each entry is checked on the CPU by `tests/test_families.py` with a template
written to its documented rules (`tests/templates/`).

A tokenizer that matches no entry is served as `general`: the same delta, no claim checked, and every turn says so.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any

from proxy.families.chatml import CHATML
from proxy.families.deepseek_v3 import DEEPSEEK_V3
from proxy.families.family import GENERAL, Family
from proxy.families.glm45 import GLM45
from proxy.families.gpt_oss import GPT_OSS
from proxy.families.kimi_k2 import KIMI_K2
from proxy.families.llama3 import LLAMA3
from proxy.families.mistral import MISTRAL
from proxy.families.qwen3 import QWEN3, QWEN3_NO_THINKING
from proxy.families.qwen3_coder import QWEN3_CODER, QWEN35

# Most particular first: the first whose `detect` holds is the tokenizer's family.
FAMILIES: tuple[Family, ...] = (
    GPT_OSS,
    MISTRAL,
    KIMI_K2,
    GLM45,
    DEEPSEEK_V3,
    LLAMA3,
    QWEN35,
    QWEN3_CODER,
    QWEN3_NO_THINKING,
    QWEN3,
    CHATML,
)
BY_NAME: Mapping[str, Family] = MappingProxyType({family.name: family for family in (*FAMILIES, GENERAL)})

__all__ = ["BY_NAME", "FAMILIES", "GENERAL", "Family", "detect", "named"]


def named(name: str) -> Family:
    """The entry `policy_options.family` names."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown family {name!r}: one of {', '.join(sorted(BY_NAME))}") from None


def detect(template: str, vocab: Collection[str], template_kwargs: Mapping[str, Any]) -> Family:
    """The family of a tokenizer, from its chat template's text and its vocabulary; an entry that implies template
    options (thinking off) only when the episode gives them. `GENERAL` when no entry fits."""
    for family in FAMILIES:
        implied = family.template_kwargs.items()
        if family.detect(template, vocab) and all(template_kwargs.get(k) == v for k, v in implied):
            return family
    return GENERAL
