"""A byte-level tokenizer's ids compared with a text as bytes: each id's bytes joined read as its Rust decode reads
them, for every family's test tokenizer, special tokens and broken UTF-8 included; the template check says the same
with the table as without it; a tokenizer that does not decode byte by byte has no table."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models

from proxy.adapters.chat_templates import ChatTemplate, _same
from proxy.adapters.token_bytes import text_bytes, token_bytes
from proxy.families import FAMILIES, named
from testkit.family_checks import tokenizer

JINJA = [family.name for family in FAMILIES if family.renderer == "jinja"]
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("name", JINJA)
def test_each_ids_bytes_joined_read_as_the_rust_decode_reads_them(name: str) -> None:
    backend = tokenizer(name).backend_tokenizer
    table = token_bytes(backend)
    assert table is not None and len(table) == backend.get_vocab_size(with_added_tokens=True)
    rng = random.Random(name)
    specials = list(backend.get_added_tokens_decoder())
    for _ in range(200):  # any ids: a character's bytes split, specials among them
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(table)) for _ in range(40)]
        joined = text_bytes(table, ids)
        assert joined is not None
        assert joined.decode(errors="replace") == backend.decode(ids, skip_special_tokens=False)
    assert text_bytes(table, [len(table)]) is None  # an id past the vocabulary: not said


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_the_template_check_says_the_same_with_the_table_as_without(name: str) -> None:
    family = named(name)
    fast = ChatTemplate(tokenizer(name), None, dict(family.template_kwargs), family)
    slow = ChatTemplate(tokenizer(name), None, dict(family.template_kwargs), family)
    slow._bytes = None
    assert fast._bytes is not None
    messages = [{"role": "system", "content": "Run commands. café ☕"}, {"role": "user", "content": "go"}]
    ids = fast.prompt(messages, TOOLS)
    assert fast.difference(ids, messages, TOOLS) is None and slow.difference(ids, messages, TOOLS) is None
    for changed in (ids[:-1], [*ids[:5], ids[6], ids[5], *ids[7:]], [*ids[:8], *fast.encode("x"), *ids[8:]]):
        found, truth = fast.difference(changed, messages, TOOLS), slow.difference(changed, messages, TOOLS)
        assert found is not None and found == truth


def test_a_tokenizer_that_does_not_decode_byte_by_byte_has_no_table() -> None:
    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert token_bytes(word_level) is None
    word_level.decoder = decoders.Metaspace()
    assert token_bytes(word_level) is None


def test_bytes_equal_to_a_lone_surrogates_are_not_its_text() -> None:
    assert not _same("\ud800".encode(errors="surrogatepass"), "\ud800")  # the decode replaces them
    assert _same("café".encode(), "café")
