"""A server's answer read as the chunks it arrived in, never joined whole.

A served turn's answer holds the whole conversation's prompt ids (vLLM's echo, `prompt_token_ids`): about 600 KB of
JSON at 100k tokens, arriving in a handful of chunks. Joined into one `bytes` it is copied once more, into memory
faulted in afresh, on every turn. `Chunks` answers what reading the echo needs where the bytes lie: where a short
text is (`find`, in C, a chunk at a time and across their seams), whether some text lies at a place (`startswith`),
a short stretch copied out (`slice`) and a long one viewed (`views`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from itertools import accumulate


class Chunks:
    """Bytes in chunks, read at offsets into their whole."""

    __slots__ = ("_chunks", "_starts", "size")

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = [chunk for chunk in chunks if chunk] or [b""]
        self._starts = list(accumulate((len(chunk) for chunk in self._chunks[:-1]), initial=0))
        self.size = self._starts[-1] + len(self._chunks[-1])

    def joined(self) -> bytes:
        return self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)

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

    def _chunk_at(self, at: int) -> int:
        return bisect_right(self._starts, at) - 1
