"""Each token id's bytes, for a byte-level tokenizer: the text of a conversation's ids compared as bytes, joined in C,
where decoding them through the Rust tokenizer took three times as long.

A byte-level decoder's text is the UTF-8 of its tokens' bytes joined (GPT-2's table maps each byte to a printable
character; a token with a character outside that table is its own UTF-8), with what is not UTF-8 replaced. Where
the joined bytes are a text's UTF-8, the decode is that text; where they are not, nothing is said and the caller
decodes. The table is made once a tokenizer, where its decoder is byte-level alone and it decodes each of its added
tokens as the table says; else there is none.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def _byte_of_character() -> dict[str, int]:
    """GPT-2's table, reversed: the character each byte is written as, to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


_BYTE = _byte_of_character()


def token_bytes(backend: Any) -> list[bytes] | None:
    """The bytes of each id of a Rust tokenizer (`backend`) whose decoder is byte-level alone, by id; None for any
    other tokenizer, or one whose added tokens decode otherwise."""
    decoder = json.loads(backend.to_str()).get("decoder")
    if not isinstance(decoder, dict) or decoder.get("type") != "ByteLevel":
        return None
    table: list[bytes] = []
    for id_ in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(id_)
        if token is None:
            return None
        try:
            table.append(bytes(map(_BYTE.__getitem__, token)))
        except KeyError:
            table.append(token.encode())
    for id_ in backend.get_added_tokens_decoder():
        if id_ >= len(table) or table[id_].decode(errors="replace") != backend.decode([id_], skip_special_tokens=False):
            return None
    return table


def text_bytes(table: list[bytes], ids: Sequence[int]) -> bytes | None:
    """The bytes the decode of `ids` reads (None where an id is not the table's)."""
    try:
        return b"".join(map(table.__getitem__, ids))
    except (IndexError, TypeError):
        return None
