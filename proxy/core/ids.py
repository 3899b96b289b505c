"""A served turn's prompt ids as machine integers: 8 bytes an id in one block, no object and no reference per id.

A continued turn's prompt is its parent's prompt ids, the ids its parent sampled, and the new messages' ids: near 120k
tokens, 120k ids, of which a few hundred are new. As a tuple, each turn's prompt cost a reference per id to make (an
increment of each id's count) and as much again to free when its turn left memory (a decrement each), 15% of a late
turn's CPU in chat mode (RESULTS.md section 42); here the parent's block is copied as bytes and freed as one.

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


class TokenIds(Sequence[int]):
    __slots__ = ("_ids",)

    _ids: array[int]

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._ids = ids._ids if isinstance(ids, TokenIds) else array(_TYPE, ids)

    @classmethod
    def joined(cls, first: Sequence[int], *more: Sequence[int]) -> TokenIds:
        """The ids of `first`, then those of each of `more`: one copy, of `first`'s bytes where it is TokenIds."""
        head = first._ids if isinstance(first, TokenIds) else array(_TYPE, first)
        tail = array(_TYPE)
        for part in more:
            tail.extend(part._ids if isinstance(part, TokenIds) else part)
        return cls._of(head + tail)

    @classmethod
    def _of(cls, ids: array[int]) -> TokenIds:
        made = cls.__new__(cls)
        made._ids = ids
        return made

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, at: int) -> int: ...
    @overload
    def __getitem__(self, at: slice) -> TokenIds: ...
    def __getitem__(self, at: int | slice) -> int | TokenIds:
        return TokenIds._of(self._ids[at]) if isinstance(at, slice) else self._ids[at]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __add__(self, other: Sequence[int]) -> TokenIds:
        return TokenIds.joined(self, other)

    def __radd__(self, other: Sequence[int]) -> TokenIds:
        return TokenIds.joined(other, self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self._ids == other._ids
        if isinstance(other, tuple | list):
            return len(other) == len(self._ids) and all(map(operator.eq, self._ids, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._ids))

    def __repr__(self) -> str:
        return f"TokenIds({self._ids.tolist()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return TokenIds, (self._ids.tolist(),)

    def tolist(self) -> list[int]:
        return self._ids.tolist()


def plain(ids: Sequence[int] | None) -> Sequence[int] | None:
    """Ids as JSON and tokenizers take them: a list for TokenIds, else as they are (a tuple or list already)."""
    return ids.tolist() if isinstance(ids, TokenIds) else ids
