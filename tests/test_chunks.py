"""A server's answer read in the chunks it arrived in: what `find`, `startswith`, `slice` and `views` say is what the
same calls on the joined bytes say, wherever the chunks were cut."""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

import pytest

from proxy.core.chunks import Chunks, grown
from proxy.http.edge import read_chunks


def cuts(rng: random.Random, data: bytes) -> list[bytes]:
    places = sorted(rng.choices(range(len(data) + 1), k=rng.randrange(0, 12)))
    bounds = [0, *places, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]  # empty chunks too, where places repeat


@pytest.mark.parametrize("seed", range(40))
def test_reads_in_chunks_are_the_joined_bytes_reads(seed: int) -> None:
    rng = random.Random(seed)
    data = bytes(rng.choice(b"ab,[]") for _ in range(rng.randrange(0, 200)))
    chunks = Chunks(cuts(rng, data))
    assert chunks.size == len(data) and b"".join(chunks.parts) == data
    for _ in range(60):
        start, end = sorted(rng.randrange(-2, len(data) + 3) for _ in range(2))
        sub = data[start : start + rng.randrange(1, 6)] if 0 <= start < len(data) else b"ab"
        sub = sub if rng.random() < 0.7 else bytes(rng.choice(b"ab,") for _ in range(rng.randrange(1, 5)))
        at = max(start, 0)
        assert chunks.find(sub, at) == data.find(sub, at), (sub, at)
        assert chunks.find(sub, start) == chunks.find(sub, at)  # no offset counted from the end
        assert chunks.startswith(sub, start) == (start >= 0 and data.startswith(sub, start))
        assert chunks.slice(start, end) == data[max(start, 0) : max(end, 0)]
        assert b"".join(chunks.views(start, end)) == data[max(start, 0) : max(end, 0)]
        assert chunks.endswith(sub) == data.endswith(sub)
        other = data[:end] + bytes(rng.choice(b"ab") for _ in range(rng.randrange(0, 4)))  # the same to `end`, or more
        for given in (other, Chunks(cuts(rng, other))):
            for n in (start, end, len(other)):
                assert chunks.same_start(given, n) == (0 <= n <= len(data) and data[:n] == other[:n]), (n, given)
    same = Chunks(cuts(rng, data))
    assert chunks == data and data == chunks and chunks == same and (chunks != same) is False
    assert chunks != data + b"a" and chunks != Chunks([data, b"a"]) and chunks != data.decode()
    assert b"".join(chunks.parts) == data and len(chunks) == len(data)
    parts = chunks.parts
    assert bytes(chunks) == data and chunks.parts == parts  # joined into a new object: the chunks left as they were


def test_views_are_into_the_chunks_not_copies() -> None:
    first, second = b"0123456789", b"abcdefghij"
    views = Chunks([first, second]).views(5, 15)
    assert [bytes(view) for view in views] == [b"56789", b"abcde"]
    assert views[0].obj is first and views[1].obj is second


def test_a_head_is_the_chunks_that_hold_it_the_last_cut() -> None:
    first, second, third = b"0123", b"4567", b"89"
    chunks = Chunks([first, second, third])
    assert chunks.head(8)[0] is first and chunks.head(8)[1] is second  # at a seam: the chunks themselves
    assert chunks.head(6) == [first, b"45"] and chunks.head(6)[0] is first
    assert [chunks.head(n) for n in (0, -1, 1)] == [[], [], [b"0"]]
    assert b"".join(chunks.head(99)) == b"0123456789"


@pytest.mark.parametrize("seed", range(5))
def test_a_body_grown_turn_by_turn_stays_a_few_chunks_each_byte_copied_a_few_times(seed: int) -> None:
    """A body kept from turn to turn, each turn its head and a few KB more: its bytes are the parts' in order, it
    stays in a few chunks, its end (a coding agent's tools, large) is never joined, and all the chunks made over 300
    turns hold a few times the final body's bytes, not once a turn."""
    rng = random.Random(seed)
    end = b"]," + b"t" * 50_000 + b"}"
    body, made = grown([b"{" * 200_000], end), 0
    seen: set[int] = set()
    alive: list[bytes] = []  # every part made, held: an id is that object's alone
    for _ in range(300):
        added = bytes([rng.randrange(97, 123)]) * rng.randrange(1, 4000)
        whole = body.joined()[: body.size - len(end)] + added + end
        body = grown([*body.head(body.size - len(end)), added], end)
        assert body == whole and body.parts[-1] is end
        assert len(body.parts) <= 17
        made += sum(len(part) for part in body.parts if id(part) not in seen and part is not end)
        seen |= {id(part) for part in body.parts}
        alive += body.parts
    assert made < 5 * body.size  # every body made anew: 300 times over


def test_no_chunks_read_as_empty() -> None:
    empty = Chunks([])
    assert (empty.size, empty.joined(), empty.find(b"a"), empty.startswith(b"", 0)) == (0, b"", -1, True)
    some = Chunks([b"ab", b"c"])
    assert [some.find(b"", at) for at in (2, 3, 4)] == [b"abc".find(b"", at) for at in (2, 3, 4)] == [2, 3, -1]


def test_a_body_read_in_a_few_chunks_is_kept_in_them_and_one_trickled_in_many_is_joined() -> None:
    """`read_chunks` over ASGI's messages: one chunk is given as it came, a few as Chunks, many joined."""

    def read(chunks: list[bytes]) -> Any:
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

        async def receive() -> Any:
            return messages.pop(0)

        return asyncio.run(read_chunks({"type": "http", "headers": []}, receive, 1 << 20))

    one = b"x" * 1000
    assert read([one]) is one and read([b""]) == b""
    few = read([b"ab", b"", b"cd"])
    assert isinstance(few, Chunks) and few == b"abcd" and few.parts == (b"ab", b"cd")
    many = read([b"%d," % i for i in range(200)])
    assert isinstance(many, bytes) and many == b"".join(b"%d," % i for i in range(200))
