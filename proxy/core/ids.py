"""A served turn's prompt ids as machine integers: 8 bytes an id, no object and no reference per id.

A continued turn's prompt is its parent's prompt ids, the ids its parent sampled, and the new messages' ids: near 120k
tokens, 120k ids, of which a few hundred are new. As a tuple, each turn's prompt cost a reference per id to make (an
increment of each id's count) and as much again to free when its turn left memory (a decrement each), 15% of a late
turn's CPU in chat mode (RESULTS.md section 42); here it holds its parent's TokenIds and its own ids alone.

`TokenIds` is an immutable sequence of ints, equal to a tuple or list of the same ids; where the ids leave the process
(JSON, a tokenizer), `plain` gives a list.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

_TYPE = "q"  # signed 64-bit: any id a JSON body or a tokenizer gives (a larger one raises OverflowError, as a tuple's
# conversion would not: the callers read ids from servers that write 32-bit ones)
_DEPTH = 64  # links in a chain of heads before it is joined into one block


class TokenIds(Sequence[int]):
    """Token ids: those of `_head` (a parent's TokenIds, or None), then those of `_tail`. A continued turn's prompt
    holds its parent's prompt as its head and only its own ids (the parent's sampled ids and the new messages') in its
    tail: made in the time of its own ids, held in their memory. What needs all the ids in one block (iteration,
    equality, a slice into the head) joins the chain's tails then, once each time; a chain is joined into one block
    every `_DEPTH` links, so that no read walks more than that."""

    __slots__ = ("_depth", "_head", "_size", "_tail")

    _head: TokenIds | None
    _tail: array[int]
    _size: int
    _depth: int

    def __init__(self, ids: Iterable[int] = ()) -> None:
        if isinstance(ids, TokenIds):
            self._head, self._tail, self._size, self._depth = ids._head, ids._tail, ids._size, ids._depth
        else:
            self._head, self._tail, self._depth = None, array(_TYPE, ids), 0
            self._size = len(self._tail)

    @classmethod
    def joined(cls, first: Sequence[int], *more: Sequence[int]) -> TokenIds:
        """The ids of `first`, then those of each of `more`: `first`'s kept as they are where it is TokenIds."""
        tail = array(_TYPE)
        for part in more:
            tail.extend(part._block() if isinstance(part, TokenIds) else part)
        if not isinstance(first, TokenIds):
            return cls._of(None, array(_TYPE, first) + tail)
        if first._depth + 1 >= _DEPTH:
            return cls._of(None, first._block() + tail)
        return cls._of(first, tail)

    @classmethod
    def _of(cls, head: TokenIds | None, tail: array[int]) -> TokenIds:
        made = cls.__new__(cls)
        made._head, made._tail = head, tail
        made._size = len(tail) + (head._size if head is not None else 0)
        made._depth = head._depth + 1 if head is not None else 0
        return made

    def _block(self) -> array[int]:
        """All the ids in one block: the chain's tails joined (the tail itself where there is no head)."""
        if self._head is None:
            return self._tail
        tails = [self._tail]
        link: TokenIds | None = self._head
        while link is not None:
            tails.append(link._tail)
            link = link._head
        block = array(_TYPE)
        for tail in reversed(tails):
            block += tail
        return block

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, at: int) -> int: ...
    @overload
    def __getitem__(self, at: slice) -> TokenIds: ...
    def __getitem__(self, at: int | slice) -> int | TokenIds:
        before = self._size - len(self._tail)  # the ids the head holds
        if isinstance(at, slice):
            start, stop, step = at.indices(self._size)
            if step == 1 and start >= before:  # within the tail: the new ids of a continued prompt, read alone
                return TokenIds._of(None, self._tail[start - before : max(stop, start) - before])
            return TokenIds._of(None, self._block()[at])
        index = at + self._size if at < 0 else at
        if not 0 <= index < self._size:
            raise IndexError("token ids index out of range")
        link: TokenIds = self
        while index < link._size - len(link._tail):
            assert link._head is not None
            link = link._head
        return link._tail[index - (link._size - len(link._tail))]

    def __iter__(self) -> Iterator[int]:
        return iter(self._block())

    def __add__(self, other: Sequence[int]) -> TokenIds:
        return TokenIds.joined(self, other)

    def __radd__(self, other: Sequence[int]) -> TokenIds:
        return TokenIds.joined(other, self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self is other or (self._size == other._size and self._block() == other._block())
        if isinstance(other, tuple | list):
            return len(other) == self._size and all(map(operator.eq, self._block(), other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._block()))

    def __repr__(self) -> str:
        return f"TokenIds({self.tolist()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return TokenIds, (self.tolist(),)

    def tolist(self) -> list[int]:
        return self._block().tolist()

    @property
    def own_bytes(self) -> int:
        """The memory its own ids take: its tail's. Its head is its parent's prompt, counted with its parent's turn
        where that is kept: a bound counted so is about, not exact (the oldest kept turn of a chain holds its head)."""
        return self._tail.itemsize * len(self._tail)


def plain(ids: Sequence[int] | None) -> Sequence[int] | None:
    """Ids as JSON and tokenizers take them: a list for TokenIds, else as they are (a tuple or list already)."""
    return ids.tolist() if isinstance(ids, TokenIds) else ids
