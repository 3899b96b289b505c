"""Bytes read as the chunks they arrived in, never joined whole where a reader can do without.

A served turn's answer holds the whole conversation's prompt ids (vLLM's echo, `prompt_token_ids`): about 600 KB of
JSON at 100k tokens, arriving in a handful of chunks; an agent's call holds its whole conversation too (about 400 KB).
Joined into one `bytes`, each is copied once more, into memory faulted in afresh, on every turn. `Chunks` answers what
reading them needs where the bytes lie: where a short text is (`find`, in C, a chunk at a time and across their
seams), whether some text lies at a place (`startswith`, `endswith`, `same_start`), a short stretch copied out
(`slice`) and a long one viewed (`views`). It equals the bytes it holds (`==`, either way round), and `bytes()` of it
joins them, for the few readers that need them whole.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from itertools import accumulate
from typing import Any, TypeAlias, overload


class Chunks:
    """Bytes in chunks, read at offsets into their whole."""

    __slots__ = ("_chunks", "_starts", "size")
    __hash__ = None  # type: ignore[assignment]  # equal to bytes, whose hash it does not compute

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = [chunk for chunk in chunks if chunk] or [b""]
        self._starts = list(accumulate((len(chunk) for chunk in self._chunks[:-1]), initial=0))
        self.size = self._starts[-1] + len(self._chunks[-1])

    def joined(self) -> bytes:
        """The bytes whole, joined (a copy) where there are more chunks than one. The chunks are left as they are:
        a turn's body is read by the event loop and by the database writer's thread at once."""
        return self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)

    __bytes__ = joined

    @property
    def parts(self) -> tuple[bytes, ...]:
        """The chunks, in order (none empty, but for no bytes at all)."""
        return tuple(self._chunks)

    def __len__(self) -> int:
        return self.size

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Chunks):
            return other.size == self.size and self.same_start(other, self.size)
        if isinstance(other, bytes):
            return len(other) == self.size and self.startswith(other, 0)
        return NotImplemented

    def __repr__(self) -> str:
        return f"Chunks({self.size} bytes in {len(self._chunks)})"

    def endswith(self, text: bytes | memoryview) -> bool:
        return len(text) <= self.size and self.startswith(text, self.size - len(text))

    def same_start(self, other: bytes | Chunks, end: int) -> bool:
        """Whether the first `end` bytes are `other`'s (a memcmp a chunk of each at a time)."""
        if not 0 <= end <= min(self.size, len(other)):
            return False
        if isinstance(other, bytes):
            return self.startswith(memoryview(other)[:end], 0)
        return all(self.startswith(view, at) for at, view in other._placed(end))

    def _placed(self, end: int) -> Iterable[tuple[int, memoryview]]:
        """Views of the first `end` bytes, each with where it starts."""
        at = 0
        for view in self.views(0, end):
            yield at, view
            at += len(view)

    def find(self, sub: bytes, start: int = 0) -> int:
        """Where `sub` first lies at or after `start` (an offset from the start: none is counted from the end, as
        `bytes.find` counts a negative one); -1 where nowhere."""
        start = max(start, 0)
        if start >= self.size:
            return start if start == self.size and not sub else -1
        first = self._chunk_at(start)
        for i in range(first, len(self._chunks)):
            chunk, begins = self._chunks[i], self._starts[i]
            within = start - begins if i == first else 0
            if (found := chunk.find(sub, within)) >= 0:
                return begins + found
            ends = begins + len(chunk)
            if ends < self.size and len(sub) > 1:  # across the seam: the last bytes of this chunk, the next's first
                seam = max(ends - len(sub) + 1, begins + within)
                if (found := self.slice(seam, ends + len(sub) - 1).find(sub)) >= 0:
                    return seam + found
        return -1

    def startswith(self, text: bytes | memoryview, at: int) -> bool:
        """Whether `text` lies at `at` (`bytes.startswith` a chunk at a time: a memcmp; comparing memoryviews steps
        through every byte)."""
        if at < 0 or at + len(text) > self.size:
            return False
        whole, done, i = memoryview(text), 0, self._chunk_at(at)
        while done < len(text):
            chunk, within = self._chunks[i], at + done - self._starts[i]
            n = min(len(chunk) - within, len(text) - done)
            if not chunk.startswith(whole[done : done + n], within):
                return False
            done, i = done + n, i + 1
        return True

    def slice(self, start: int, end: int) -> bytes:
        """The bytes from `start` to `end`, copied: for short stretches."""
        return b"".join(self.views(start, end))

    def views(self, start: int, end: int) -> list[memoryview]:
        """The bytes from `start` to `end` as views into the chunks that hold them, nothing copied."""
        start, end = max(start, 0), min(end, self.size)
        out: list[memoryview] = []
        i = self._chunk_at(start) if start < end else len(self._chunks)
        while i < len(self._chunks) and start < end:
            chunk, begins = self._chunks[i], self._starts[i]
            upto = min(end - begins, len(chunk))
            out.append(memoryview(chunk)[start - begins : upto])
            start = begins + upto
            i += 1
        return out

    def head(self, end: int) -> list[bytes]:
        """The first `end` bytes as the chunks that hold them, the last cut (a copy of what it keeps) where `end`
        falls inside it."""
        end = min(max(end, 0), self.size)
        if end == 0:
            return []
        i = self._chunk_at(end - 1)
        cut = end - self._starts[i]
        last = self._chunks[i]
        return [*self._chunks[:i], last if cut == len(last) else last[:cut]]

    def _chunk_at(self, at: int) -> int:
        return bisect_right(self._starts, at) - 1


Body: TypeAlias = bytes | Chunks  # an agent's request body: read in one chunk, bytes; in more, Chunks


def grown(parts: list[bytes], end: bytes, most: int = 16) -> Chunks:
    """Chunks of `parts` then `end`: a body kept from turn to turn, each turn the one before up to its end, a few
    more parts, and the same end. Past `most` parts they are `doubled`, so that it stays a few chunks and each of its
    bytes is copied a few times in all, not once a turn; `end` is never joined (it can be large: a coding agent's
    tools follow its messages)."""
    return Chunks((*(parts if len(parts) < most else doubled(parts)), end))


@overload
def doubled(parts: Iterable[bytes]) -> list[bytes]: ...


@overload
def doubled(parts: Iterable[bytes | memoryview]) -> list[bytes | memoryview]: ...


def doubled(parts: Iterable[Any]) -> list[Any]:
    """Neighbours joined until each part is over twice the size of the one after it: a text that gains a few small
    parts at its end each turn, so held, is a few parts larger and larger towards its start (a handful of comparisons
    and writes a turn, each in C), and each of its bytes is copied once each time its part doubles."""
    merged: list[Any] = []
    for part in parts:
        merged.append(part)
        while len(merged) > 1 and 2 * len(merged[-1]) > len(merged[-2]):
            last = merged.pop()
            merged[-1] = b"".join((merged[-1], last))
    return merged


def chunked(data: Body) -> Chunks:
    """The bytes as Chunks (one, where they are bytes)."""
    return data if isinstance(data, Chunks) else Chunks((data,))
