"""`TokenIds`, a served turn's prompt ids as machine integers, reads as the tuple it replaced: equal to the same ids in
a tuple or list (and hashed alike), sliced, joined, iterated and pickled as one, and written as JSON through `plain`;
a continued turn's prompt is its parent's ids and the new ones, the parent's untouched."""

from __future__ import annotations

import copy
import pickle
import random
from dataclasses import replace

import orjson
import pytest

from proxy.core.ids import TokenIds, plain
from proxy.core.prefixes import extension_of
from proxy.core.values import Reply


def test_token_ids_read_as_the_tuple_of_the_same_ids() -> None:
    rng = random.Random(7)
    ids = tuple(rng.randrange(150_000) for _ in range(5_000))
    held = TokenIds(ids)
    assert held == ids and ids == held and held == list(ids) and ids != held[:-1]
    assert held != ids[:-1] and held != (*ids[:-1], ids[-1] + 1) and held != "not ids"
    assert hash(held) == hash(ids) and len(held) == len(ids) and tuple(held) == ids
    assert held[0] == ids[0] and held[-1] == ids[-1] and held[100:200] == ids[100:200]
    assert isinstance(held[100:200], TokenIds) and held[::-1] == ids[::-1]
    assert held.index(ids[42]) == ids.index(ids[42]) and ids[42] in held and held.count(ids[7]) == ids.count(ids[7])
    assert pickle.loads(pickle.dumps(held)) == held and copy.deepcopy(held) == held
    assert orjson.dumps(plain(held)) == orjson.dumps(ids) and plain(ids) is ids and plain(None) is None


def test_a_continued_prompt_is_its_parents_ids_then_the_new_ones_and_the_parent_keeps_its_own() -> None:
    parent = TokenIds(range(1_000))
    sampled, new = (5, 6, 7), [8, 9]
    child = TokenIds.joined(parent, sampled, new)
    assert child == (*range(1_000), 5, 6, 7, 8, 9) and parent == tuple(range(1_000))
    assert parent + sampled == (*range(1_000), 5, 6, 7) and sampled + TokenIds(new) == (5, 6, 7, 8, 9)
    assert extension_of(parent, sampled, child) is None and extension_of(parent, sampled, child[:500]) == 500
    assert extension_of(tuple(parent), sampled, (*range(10), 99)) == 10


def test_a_reply_holding_token_ids_is_a_value_as_before() -> None:
    ids = (1, 2, 3)
    held, plain_reply = Reply(prompt_token_ids=TokenIds(ids)), Reply(prompt_token_ids=ids)
    assert held == plain_reply and hash(held) == hash(plain_reply) and replace(held) == held


def test_ids_that_do_not_fit_in_64_bits_or_are_not_integers_are_refused() -> None:
    with pytest.raises(OverflowError):
        TokenIds([1 << 64])
    with pytest.raises(TypeError):
        TokenIds([1.5])  # type: ignore[list-item]


def test_a_chain_of_continued_prompts_reads_as_its_ids_at_every_link() -> None:
    rng = random.Random(11)
    expected: list[int] = list(range(50))
    prompts, prompt = [], TokenIds(expected)
    for _ in range(150):  # past the depth at which a chain is joined into one block
        more = [rng.randrange(1_000) for _ in range(rng.randrange(0, 9))]
        prompt = TokenIds.joined(prompt, more[:2], more[2:])
        expected += more
        prompts.append((prompt, tuple(expected)))
    for held, ids in prompts:
        assert held == ids and len(held) == len(ids) and held.tolist() == list(ids)
        for at in (0, 1, len(ids) // 3, len(ids) - 1, -1, -len(ids)):
            assert held[at] == ids[at]
        for start, stop in ((0, 5), (len(ids) - 4, len(ids)), (len(ids) // 2, None), (-3, None), (7, 3)):
            assert held[start:stop] == ids[start:stop]
    with pytest.raises(IndexError):
        prompts[-1][0][len(prompts[-1][1])]
