"""What the model families' CPU checks and the delta benchmark share: a tokenizer made on the spot (byte-level, no
merges, the family's special tokens added: no download, no model) and the family's test template
(`tests/templates/<name>.jinja`, written to the family's documented rules)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).resolve().parents[1] / "tests" / "templates"

# Each family's special tokens, as its tokenizer holds them (the first is its eos).
SPECIALS: dict[str, tuple[str, ...]] = {
    "chatml": ("<|im_end|>", "<|im_start|>", "<|endoftext|>", "<tool_call>", "</tool_call>"),
    "qwen3": ("<|im_end|>", "<|im_start|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<think>", "</think>"),
    "qwen3.5": ("<|im_end|>", "<|im_start|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<think>", "</think>"),
    "qwen3-coder": ("<|im_end|>", "<|im_start|>", "<|endoftext|>", "<tool_call>", "</tool_call>"),
    "llama3": (
        "<|eot_id|>",
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
    ),
    "deepseek-v3": (
        "<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "</think>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁output▁begin｜>",
        "<｜tool▁output▁end｜>",
    ),
    "glm4.5": (
        "<|endoftext|>",
        "[gMASK]",
        "<sop>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|observation|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
    ),
    "kimi-k2": (
        "<|im_end|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_system|>",
        "<|im_middle|>",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ),
}
TEMPLATE_OF = {"qwen3-no-thinking": "qwen3"}


def template(family: str) -> str:
    return (TEMPLATES / f"{TEMPLATE_OF.get(family, family)}.jinja").read_text(encoding="utf-8")


@cache
def tokenizer(family: str) -> Any:
    """A byte-level tokenizer with no merges, the family's special tokens and its test template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # lazy: transformers' own dependency
    from transformers import PreTrainedTokenizerFast  # lazy: seconds to import

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    base = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    base.decoder = decoders.ByteLevel()
    specials = SPECIALS[TEMPLATE_OF.get(family, family)]
    made = PreTrainedTokenizerFast(tokenizer_object=base, eos_token=specials[0])
    made.add_special_tokens({"additional_special_tokens": list(specials[1:])})
    made.chat_template = template(family)
    return made
