"""A turn's token ids in its `token_ids` column, each id of an episode stored once.

A reply's prompt ids mostly repeat its parent turn's prompt and sampled ids, then add a few (the new messages). So
the column holds how many leading ids the prompt shares with its parent's (`at`), the prompt's ids after them, and
the ids sampled, packed at 4 bytes an id behind a 12-byte header: `at`, the count of the prompt's own ids (-1: no
prompt ids) and of the sampled ids (-1: none). `at` 0 is a prompt written whole. Where `at` comes from: the writer
thread knows how many ids the turns it wrote hold (`Lengths`), and a reply says whether its prompt extends its
parent's ids or where it drifts (`extends_parent`, `drift_at`, set in `proxy.core.answers`); a parent the writer did
not write (another replica's, one from before a restart) gets the prompt written whole. Ids that do not fit in 32
bits are left in the reply's JSON, as every reply's ids were before this column (`ids_of` reads both), and no
prompt is written against them.

A turn's prompt is read from its chain of parents, all of its episode, each row once (`Ids`): reading an episode
reads each id once.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, and_, or_, select

from proxy.core.errors import StorageError
from proxy.core.values import Reply, Turn
from proxy.storage.tables import TurnRow

turns = TurnRow.__table__  # type: ignore[attr-defined]

_HEADER = struct.Struct("<iii")
_LENGTHS = 1 << 16  # turns whose id counts the writer thread keeps (an episode's next turn needs its last's)
_AT_ONCE = 500
_SWAP = sys.byteorder != "little"

Ids = tuple[tuple[int, ...] | None, tuple[int, ...] | None]  # prompt ids, sampled ids


def pack(reply: Reply, at: int) -> bytes | None:
    """The column for a reply whose prompt shares its first `at` ids with its parent's; None where it has no ids, or
    ids that do not fit (its JSON keeps them)."""
    prompt, sampled = reply.prompt_token_ids, reply.completion_token_ids
    if prompt is None and sampled is None:
        return None
    packed = array("i")
    try:
        if prompt is not None:
            packed.extend(prompt[at:] if at else prompt)
        if sampled is not None:
            packed.extend(sampled)
    except OverflowError:
        return None
    if _SWAP:
        packed.byteswap()
    own = -1 if prompt is None else len(prompt) - at
    return _HEADER.pack(at if prompt is not None else 0, own, -1 if sampled is None else len(sampled)) + bytes(packed)


def whole_ids(reply: Reply) -> bytes | None:
    """The column for a reply's ids written whole (not against its parent's)."""
    return pack(reply, 0)


def unpack(blob: bytes) -> tuple[int, tuple[int, ...] | None, tuple[int, ...] | None]:
    """`at`, the prompt's own ids, and the sampled ids."""
    at, own, sampled = _HEADER.unpack_from(blob)
    ids = array("i")
    ids.frombytes(blob[_HEADER.size :])
    if _SWAP:
        ids.byteswap()
    values = tuple(ids)
    prompt = values[:own] if own >= 0 else None
    return at, prompt, values[max(own, 0) :] if sampled >= 0 else None


class Lengths:
    """How many ids (prompt and sampled) the turns the writer thread wrote hold, learned once a write commits."""

    def __init__(self) -> None:
        self._known: OrderedDict[str, int] = OrderedDict()

    def column(self, turn: Turn) -> tuple[bytes | None, tuple[str, int] | None]:
        """The turn's `token_ids` column, its prompt written against its parent's ids where this thread knows them,
        and what to learn of it once it commits (its id and how many ids it holds), if its ids are in the column."""
        reply = turn.reply
        if reply is None:
            return None, None
        at = 0
        held = self._known.get(turn.parent_id) if turn.parent_id is not None else None
        if held is not None and reply.prompt_token_ids is not None:
            if reply.extends_parent:
                at = held
            elif reply.drift_at is not None:
                at = min(reply.drift_at, held)
        column = pack(reply, at)
        prompt, sampled = reply.prompt_token_ids, reply.completion_token_ids
        if column is None or prompt is None or sampled is None:
            return column, None
        return column, (turn.id, len(prompt) + len(sampled))

    def learn(self, committed: Iterable[tuple[str, int]]) -> None:
        known = self._known
        for turn_id, count in committed:
            known[turn_id] = count
            known.move_to_end(turn_id)
        while len(known) > _LENGTHS:
            known.popitem(last=False)


def ids_of(conn: Connection, rows: Sequence[Any]) -> dict[str, Ids]:
    """The prompt and sampled ids of these rows (with `id`, `episode_id`, `seq`, `parent_id`, `reply`, `token_ids`)
    that have ids, their prompts put back together from their parents' (read from the database where not among
    them)."""
    stored: dict[str, tuple[str | None, bytes]] = {}
    found: dict[str, Ids] = {}
    for row in rows:
        if row.token_ids is not None:
            stored[row.id] = (row.parent_id, bytes(row.token_ids))
        elif row.reply is not None and ("prompt_token_ids" in row.reply or "completion_token_ids" in row.reply):
            found[row.id] = (_ints(row.reply.get("prompt_token_ids")), _ints(row.reply.get("completion_token_ids")))
    _parents(conn, [row for row in rows if row.id in stored], stored, found)
    out: dict[str, Ids] = {}
    for row in rows:
        if row.id in stored:
            out[row.id] = _resolved(row.id, stored, found)
        elif row.id in found:
            out[row.id] = found[row.id]
    return out


def _resolved(turn_id: str, stored: dict[str, tuple[str | None, bytes]], found: dict[str, Ids]) -> Ids:
    """A turn's ids, from its chain of parents (each resolved once, iteratively: a chain is an episode long)."""

    def base_of(at: str) -> str | None:
        parent_id, blob = stored[at]
        return parent_id if _HEADER.unpack_from(blob)[0] else None

    for step in reversed(chain_of(turn_id, stored, base_of, found, "token ids")):
        parent_id, blob = stored[step]
        shared, own, sampled = unpack(blob)
        if shared and own is not None:
            assert parent_id is not None
            before, after = found[parent_id]
            if before is None or after is None or shared > len(before) + len(after):
                raise StorageError(f"turn {step}'s token ids are written against ids its parent {parent_id} lacks")
            start = before[:shared] if shared <= len(before) else before + after[: shared - len(before)]
            own = start + own
        found[step] = (own, sampled)
    return found[turn_id]


def chain_of(
    turn_id: str, rows: Container[str], base_of: Callable[[str], str | None], done: Container[str], what: str
) -> list[str]:
    """The turns from `turn_id` back along their bases (`base_of`) to one `done` or with no base, latest first; each
    must be among `rows`, the turns read."""
    path: list[str] = []
    at: str | None = turn_id
    while at is not None and at not in done:
        if at not in rows:
            raise StorageError(f"the database lacks turn {at}, on which turn {turn_id}'s {what} is written")
        path.append(at)
        at = base_of(at)
    return path


def _parents(
    conn: Connection, rows: Sequence[Any], stored: dict[str, tuple[str | None, bytes]], found: dict[str, Ids]
) -> None:
    """Read the rows of the parents these turns' prompts are written against: each episode's turns before the latest
    of them, in one range."""
    spans: dict[str, int] = {}
    for row in rows:
        if row.parent_id is not None and row.parent_id not in stored and _HEADER.unpack_from(row.token_ids)[0]:
            spans[row.episode_id] = max(spans.get(row.episode_id, 0), row.seq)
    ranges = list(spans.items())
    for start in range(0, len(ranges), _AT_ONCE):
        within = [and_(turns.c.episode_id == e, turns.c.seq < seq) for e, seq in ranges[start : start + _AT_ONCE]]
        query = select(turns.c.id, turns.c.parent_id, turns.c.token_ids)
        for row in conn.execute(query.where(or_(*within), turns.c.token_ids.is_not(None))):
            stored.setdefault(row.id, (row.parent_id, bytes(row.token_ids)))


def _ints(value: Any) -> tuple[int, ...] | None:
    return tuple(value) if value is not None else None
