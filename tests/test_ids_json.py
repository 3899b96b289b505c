"""Token ids as JSON text: a server's echo of the prompt ids cut out of its answer only where it is the one echo, where
the ids are read from, and written as servers write it; the ids' text kept for a turn's child within its bound; an
echo read after its parent's ids where it extends them."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.adapters.ids_json import (
    Echo,
    IdsJson,
    Pieces,
    chained,
    compacted,
    cut_echo,
    dumped,
    joined,
    new_ids,
    pieces,
    token_ids,
)
from proxy.core.chunks import Chunks
from proxy.core.ids import TokenIds


def completion(echo: bytes, *, top: bytes = b"") -> bytes:
    choice = b'{"index":0,"text":"say \\"prompt_token_ids\\": [1]","token_ids":[7,8],"prompt_token_ids":' + echo + b"}"
    return b'{"id":"cmpl-1",' + top + b'"choices":[' + choice + b'],"usage":{"prompt_tokens":3}}'


def cut(content: bytes, where: str, known: Pieces | None = None) -> Echo | None:
    """`cut_echo` of the answer whole, and of the answer in chunks cut at every place (and a byte a chunk): the same
    echo, however the answer arrived."""
    splits = [[content[:i], content[i:]] for i in range(1, len(content))] + [[bytes([b]) for b in content]]
    whole = cut_echo(Chunks([content]), where, *(() if known is None else (known,)))
    for chunks in splits:
        echo = cut_echo(Chunks(chunks), where, *(() if known is None else (known,)))
        assert (echo is None) == (whole is None)
        if echo is not None and whole is not None:
            assert (echo.response, b"".join(echo.text), echo.after) == (
                whole.response,
                b"".join(whole.text),
                whole.after,
            )
    return whole


def test_the_one_echo_on_the_choice_is_cut_out_as_text() -> None:
    echo = cut(completion(b"[1,22,333]"), "choice")
    assert echo is not None and b"".join(echo.text) == b"[1,22,333]" and echo.after is None
    assert echo.response["choices"][0] == {
        "index": 0,
        "text": 'say "prompt_token_ids": [1]',  # the key's text inside a string is no echo
        "token_ids": [7, 8],
        "prompt_token_ids": None,
    }
    assert echo.response["usage"] == {"prompt_tokens": 3}


@pytest.mark.parametrize(
    ("content", "where"),
    [
        (completion(b"[1, 22, 333]"), "choice"),  # another spacing: parsed whole, as before
        (completion(b"[1,-2]"), "choice"),
        (completion(b"null"), "choice"),
        (completion(b"[1,2]", top=b'"prompt_token_ids":[1,2],'), "choice"),  # two echoes
        (completion(b"[1,2]"), "top"),  # not where the ids are read from
        (b'{"choices":[{"meta":{"prompt_token_ids":[1,2]}}]}', "choice"),
        (b'{"choices":[{"text":"a"}]}', "choice"),
    ],
)
def test_an_echo_not_as_servers_write_it_is_left_to_the_whole_parse(content: bytes, where: str) -> None:
    assert cut(content, where) is None


def test_ids_text_is_joined_and_kept_for_the_same_objects_only() -> None:
    assert joined(b"[1,2]", b"[]", b"[3]") == b"[1,2,3]" == dumped((1, 2, 3))
    assert joined(b"[]", b"[]") == b"[]"
    assert b"".join(chained(pieces(b"[1,2]"), pieces(b"[]"), chained(pieces(b"[3]"), pieces(b"[4]")))) == b"[1,2,3,4]"
    ids = IdsJson(kept_bytes=64)
    prompt, sampled = (1, 2, 3), (4,)
    ids.keep(prompt, sampled, pieces(b"[1,2,3,4,9]"))  # (a text that is not theirs: the test tells where it came from)
    assert b"".join(ids.of(prompt, sampled)) == b"[1,2,3,4,9]"
    assert b"".join(ids.of(tuple(orjson.loads(b"[1,2,3]")), sampled)) == b"[1,2,3,4]"  # equal ids, other objects
    ids.keep((5,) * 4, (6,), pieces(b"[5,5,5,5,6]"))  # 11 + 40 bytes: over 64 with the first, which goes
    assert b"".join(ids.of(prompt, sampled)) == b"[1,2,3,4]"


def test_a_childs_ids_kept_let_its_parents_go() -> None:
    ids = IdsJson()
    parent, sampled = (1, 2), (3,)
    ids.keep(parent, sampled, pieces(b"[1,2,3,9]"))
    other = (7,)
    ids.keep(other, (), pieces(b"[7]"))  # another chain's: kept
    child = (1, 2, 3, 4)
    ids.keep(child, (5,), pieces(b"[1,2,3,4,5]"), parent)
    assert b"".join(ids.of(child, (5,))) == b"[1,2,3,4,5]" and b"".join(ids.of(other, ())) == b"[7]"
    assert b"".join(ids.of(parent, sampled)) == b"[1,2,3]"  # dumped again: its text was let go
    assert len(ids._kept) == 2 and ids._bytes == sum(kept.size for kept in ids._kept.values())


def test_kept_text_counts_all_of_what_its_views_hold() -> None:
    ids = IdsJson(kept_bytes=920)
    body = b"x" * 900 + b"[1]"
    ids.keep((1,), (), pieces(memoryview(body)[900:]))  # 903 bytes held, the brackets and 8: 913, within it
    assert b"".join(ids.of(*ids_of(ids))) == b"[1]"
    ids.keep((2,), (), pieces(b"[2]"))  # 13 more: over, and the first goes
    assert len(ids._kept) == 1


def test_a_served_prompt_kept_counts_its_own_ids_not_its_parents() -> None:
    """Twenty episodes continuing a conversation of a million ids by 1,000 each (TokenIds: the million are their
    head's, held once): their text kept in 4 MiB, where 8 bytes for every id made each 8 MB and kept none."""
    conversation = TokenIds(range(2**20))
    ids = IdsJson(kept_bytes=4 << 20)
    kept = []
    for i in range(20):
        prompt, sampled, text = TokenIds.joined(conversation, range(i, i + 1000)), (7,), pieces(b"[7]")
        ids.keep(prompt, sampled, text)
        kept.append((prompt, sampled, text))
    assert all(ids.of(prompt, sampled) is text for prompt, sampled, text in kept)


def ids_of(ids: IdsJson) -> tuple[tuple[int, ...], tuple[int, ...]]:
    (kept,) = ids._kept.values()
    return tuple(kept.prompt), tuple(kept.sampled)


@pytest.mark.parametrize(
    ("echo", "before", "new"),
    [
        (b"[1,2,3,44]", b"[1,2]", [3, 44]),
        (b"[1,2]", b"[1,2]", []),
        (b"[1,23]", b"[1,2]", None),  # 23 is not 2 then more
        (b"[1]", b"[1,2]", None),
        (b"[9,2,3]", b"[1,2]", None),
        (b"[1,2,3]", b"[]", None),  # no parent's ids to extend
        (b"[1,2,,3]", b"[1,2]", None),  # not JSON after them: parsed whole, which says so
        (b"[1,2,]", b"[1,2]", None),  # a comma and no id (once read as no new ids): parsed whole, which says so
        (b"[1,2,99999999999999999999999]", b"[1,2]", None),  # past 64 bits: parsed whole, which says so
        (b"[1,2,9223372036854775808]", b"[1,2]", None),  # past what an id is held in
    ],
)
def test_an_echo_extends_its_parents_ids_token_for_token(echo: bytes, before: bytes, new: list[int] | None) -> None:
    known: Pieces = chained(*(pieces(dumped([i])) for i in orjson.loads(before)))  # a piece an id
    found = cut(completion(echo), "choice", known)  # in pieces, as a parent's are kept
    assert found is not None and b"".join(found.text) == echo
    assert new_ids(found) == new


@pytest.mark.parametrize("echo", [b"[1,2,x]", b"[1,2,-3]", b"[1, 2]", b"[1,2,3,4 ]"])
def test_an_echo_after_its_parents_ids_is_checked_for_what_it_holds(echo: bytes) -> None:
    assert cut(completion(echo), "choice", pieces(b"[1,2]")) is None


def test_a_text_growing_turn_by_turn_is_kept_in_few_pieces_and_copied_a_few_times_in_all() -> None:
    """500 turns of a few ids each: the text as it was, in at most a few dozen pieces, its bytes copied a few times in
    all (joined on every turn, the copies would be 250 times the text)."""
    text: Pieces = pieces(dumped(list(range(1000))))
    expected = list(range(1000))
    copied = most = 0
    for turn in range(500):
        new = [1000 + 7 * turn + k for k in range(7)]
        grown = chained(text, pieces(dumped(new)))
        text = compacted(grown)
        expected += new
        assert orjson.loads(b"".join(text)) == expected
        copied += sum(len(piece) for piece in text if not any(piece is was for was in grown))
        most = max(most, len(text))
    assert most <= 16 + 1
    assert copied < 12 * len(b"".join(text))
    assert compacted(pieces(b"[1,2]")) == pieces(b"[1,2]")  # few pieces: as they are


@pytest.mark.parametrize(
    ("value", "empty", "ids"),
    [
        ([0, 7, (1 << 63) - 1], False, True),
        ([], True, True),
        ([], False, False),
        ([True, 2], False, False),  # a bool is an int to Python, and to a sum
        ([1, 2.0], False, False),
        ([1, -2], False, False),
        ([1, 1 << 63], False, False),
        ([1, 1 << 64], False, False),
        ([1, "2"], False, False),
        ([1, None], False, False),
        ([1, [2]], False, False),
        ((1, 2), False, False),
    ],
)
def test_token_ids_are_non_negative_integers_that_fit_64_bits(value: Any, empty: bool, ids: bool) -> None:
    assert token_ids(value, empty=empty) is ids
