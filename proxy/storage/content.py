"""A turn as its row: its columns (`turn_row`; `turn_state`, what changes once it is parked) and its content.

Turns' wire bodies and requests in the `piece` table: written on the writer thread (`Contents`, `TurnWrite`),
read back for any set of turn rows (`turns_of`). See `proxy.storage.pieces` for how they are cut and listed.

A turn's lists of piece hashes are written as a difference from the lists of its episode's last turn written
before it (its base), and whole every `CHAIN` turns, so a turn is read from at most that many turns' rows, all of
its own episode, and an episode's turns from their rows and the distinct pieces they name: the size of its distinct
content, not of its calls times its context.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import orjson
from sqlalchemy import Connection, Executable, and_, or_, select
from sqlalchemy.dialects import postgresql, sqlite

from proxy.core.errors import StorageError
from proxy.core.values import AgentError, JsonObject, Reply, Turn, TurnStatus, Usage
from proxy.storage.pieces import (
    cut,
    decode_parts,
    encode_parts,
    pack,
    request_from,
    unpack,
)
from proxy.storage.tables import Op, PieceRow, TurnRow

pieces = PieceRow.__table__  # type: ignore[attr-defined]
turns = TurnRow.__table__  # type: ignore[attr-defined]

CHAIN = 32  # a turn's lists are written whole at least once in this many turns of its episode
# A call this small is stored in its turn's row as it is (no `whole_seq`): pieces would save little and cost as much
# again in hashing on the writer thread, which shares its core with serving (the turns benchmark's calls).
INLINE_BELOW = 2048
_KNOWN = 1 << 18  # hashes of pieces this process knows are stored (it skips writing them again)
_HELD = 1 << 19  # hashes held for episodes' last turns, all episodes together
_AT_ONCE = 500  # hashes or ranges in one SELECT (under SQLite's and Postgres's limits on parameters)


# A turn's row


def turn_state(turn: Turn) -> dict[str, Any]:
    """The columns of a turn that change after it is parked."""
    reply = turn.reply
    usage = reply.usage if reply else None
    return {
        "id": turn.id,
        "status": turn.status.value,
        "deliveries": turn.deliveries,
        "leased_at": turn.leased_at,
        "answered_at": turn.answered_at,
        "ended_at": turn.ended_at,
        "reason": turn.reason,
        "reply": _reply_json(reply) if reply else None,
        "answered_by": reply.answered_by if reply else None,
        "policy_version": reply.policy_version if reply else None,
        "cost_usd": reply.cost_usd if reply else None,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else None,
    }


TURN_STATE = (
    "id",
    "status",
    "deliveries",
    "leased_at",
    "answered_at",
    "ended_at",
    "reason",
    "reply",
    "answered_by",
    "policy_version",
    "cost_usd",
    "prompt_tokens",
    "completion_tokens",
)

# What settling a turn writes where replicas share the database: not its deliveries, which the shared queue keeps.
TURN_SETTLED = tuple(column for column in TURN_STATE if column not in ("id", "deliveries", "leased_at"))


def turn_row(turn: Turn) -> dict[str, Any]:
    """The turn's columns but its wire body and request, which are stored as pieces (`proxy.storage.content`)."""
    return {
        **turn_state(turn),
        "episode_id": turn.episode_id,
        "seq": turn.seq,
        "dialect": turn.dialect,
        "stream": turn.stream,
        "model": turn.model,
        "created_at": turn.created_at,
        "trainable": turn.trainable,
        "branch": turn.branch,
        "parent_id": turn.parent_id,
    }


def turn_from(row: Any, wire: bytes, request: JsonObject) -> Turn:
    """The turn a row holds, given its wire body and request put back together from their pieces."""
    return Turn(
        id=row.id,
        episode_id=row.episode_id,
        seq=row.seq,
        dialect=row.dialect,
        request=request,
        wire=wire,
        stream=row.stream,
        status=TurnStatus(row.status),
        created_at=row.created_at,
        model=row.model,
        deliveries=row.deliveries,
        leased_at=row.leased_at,
        answered_at=row.answered_at,
        ended_at=row.ended_at,
        reply=_reply_from(row) if row.reply is not None else None,
        reason=row.reason,
        trainable=row.trainable,
        branch=row.branch,
        parent_id=row.parent_id,
    )


def _reply_json(reply: Reply) -> JsonObject:
    data: JsonObject = {"message": reply.message, "finish_reason": reply.finish_reason}
    if reply.error is not None:
        data["error"] = {"status": reply.error.status, "message": reply.error.message, "type": reply.error.kind}
    for name in ("prompt_token_ids", "completion_token_ids", "logprobs"):
        value = getattr(reply, name)
        if value is not None:
            data[name] = list(value)
    for name in ("served", "extends_parent", "drift_at"):
        if (value := getattr(reply, name)) is not None:
            data[name] = value
    return data


def _reply_from(row: Any) -> Reply:
    data = row.reply
    error = data.get("error")

    def ints(name: str) -> tuple[int, ...] | None:
        value = data.get(name)
        return tuple(value) if value is not None else None

    logprobs = data.get("logprobs")
    return Reply(
        message=data.get("message"),
        finish_reason=data.get("finish_reason"),
        usage=Usage(row.prompt_tokens, row.completion_tokens) if row.prompt_tokens is not None else None,
        error=AgentError(error["status"], error["message"], error["type"]) if error else None,
        prompt_token_ids=ints("prompt_token_ids"),
        completion_token_ids=ints("completion_token_ids"),
        logprobs=tuple(logprobs) if logprobs is not None else None,
        policy_version=row.policy_version,
        answered_by=row.answered_by or "trainer",
        cost_usd=row.cost_usd,
        served=data.get("served"),
        extends_parent=data.get("extends_parent"),
        drift_at=data.get("drift_at"),
    )


def dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


# Its content


def insert_pieces(dialect: str) -> Executable:
    """INSERT of pieces that leaves those already stored as they are (another turn, or replica, wrote them)."""
    make = postgresql.insert if dialect == "postgresql" else sqlite.insert
    return make(pieces).on_conflict_do_nothing(index_elements=["hash"])


@dataclass(slots=True)
class _Last:
    """An episode's last turn written: what the next turn's lists are written against."""

    id: str
    episode_id: str
    seq: int
    whole_seq: int
    depth: int  # turns since its lists were last written whole
    wire: list[bytes]
    request: list[bytes]


class Contents:
    """What the writer thread knows of the pieces it wrote (only there: no lock), learned once a write commits."""

    def __init__(self, dialect: str) -> None:
        self.insert = insert_pieces(dialect)
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._last: OrderedDict[str, _Last] = OrderedDict()
        self._held = 0

    def write(self, turn: Turn, statement: Executable, shape: Callable[[dict[str, Any]], dict[str, Any]]) -> TurnWrite:
        """The write of a new turn: `statement` run with `shape` of its row (its columns, pieces' lists included)."""
        return TurnWrite(self, turn, statement, shape)

    def learn(self, stored: Sequence[bytes], last: _Last) -> None:
        """A write committed: its pieces are stored, and its turn is its episode's last."""
        known = self._known
        for h in stored:
            known[h] = None
            known.move_to_end(h)
        while len(known) > _KNOWN:
            known.popitem(last=False)
        if (before := self._last.pop(last.episode_id, None)) is not None:
            self._held -= len(before.wire) + len(before.request)
        self._last[last.episode_id] = last
        self._held += len(last.wire) + len(last.request)
        while self._held > _HELD and len(self._last) > 1:
            _, gone = self._last.popitem(last=False)
            self._held -= len(gone.wire) + len(gone.request)


class TurnWrite:
    """A new turn's write, cut into pieces on the writer thread (`ops`), its pieces and list learned once it
    commits (`committed`)."""

    def __init__(
        self, contents: Contents, turn: Turn, statement: Executable, shape: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> None:
        self._contents = contents
        self._turn = turn
        self._statement = statement
        self._shape = shape
        self._cut: tuple[list[bytes], list[bytes], dict[bytes, bytes]] | None = None
        self._written: tuple[list[bytes], _Last] | None = None

    def ops(self) -> tuple[list[Op], list[Op]]:
        """The pieces not known to be stored (to write first), and the turn's row."""
        turn, contents = self._turn, self._contents
        if len(turn.wire) < INLINE_BELOW:
            inline = {"base_id": None, "whole_seq": None, "wire_parts": turn.wire}
            return [], [(self._statement, [self._shape(turn_row(turn) | inline | {"request_parts": _json(turn)})])]
        if self._cut is None:
            self._cut = cut(turn.wire, turn.request)
        wire, request, data = self._cut
        last = contents._last.get(turn.episode_id)
        if last is not None and last.depth + 1 < CHAIN and last.seq < turn.seq:
            base_id, whole_seq, depth = last.id, last.whole_seq, last.depth + 1
            wire_parts, request_parts = encode_parts(wire, last.wire), encode_parts(request, last.request)
        else:
            base_id, whole_seq, depth = None, turn.seq, 0
            wire_parts, request_parts = encode_parts(wire, None), encode_parts(request, None)
        new = sorted(h for h in data if h not in contents._known)  # in one order: replicas' inserts never deadlock
        row = turn_row(turn) | {
            "base_id": base_id,
            "whole_seq": whole_seq,
            "wire_parts": wire_parts,
            "request_parts": request_parts,
        }
        self._written = (new, _Last(turn.id, turn.episode_id, turn.seq, whole_seq, depth, wire, request))
        first: list[Op] = [(contents.insert, [{"hash": h, "data": pack(data[h])} for h in new])] if new else []
        return first, [(self._statement, [self._shape(row)])]

    def committed(self) -> None:
        if self._written is not None:
            self._contents.learn(*self._written)


def _json(turn: Turn) -> bytes:
    return orjson.dumps(turn.request)


# Reading


def turns_of(conn: Connection, rows: Sequence[Any]) -> list[Turn]:
    """The turns these rows (all of `turn`'s columns) hold, their wire bodies and requests put back together."""
    wires, requests = _contents(conn, rows, wires=True)
    return [turn_from(row, wire, request) for row, wire, request in zip(rows, wires, requests, strict=True)]


def with_requests(conn: Connection, rows: Sequence[Any]) -> list[SimpleNamespace]:
    """These rows (of `turn`'s columns, with `CHAIN_COLUMNS`), each with its request put back together as `request`
    (not its wire body, which is not read)."""
    _, requests = _contents(conn, rows, wires=False)
    return [SimpleNamespace(**row._mapping, request=request) for row, request in zip(rows, requests, strict=True)]


def wire_bodies(conn: Connection, rows: Sequence[Any]) -> list[bytes]:
    """The wire bodies of these rows (with `id`, `episode_id`, `seq` and `CHAIN_COLUMNS`)."""
    return _contents(conn, rows, wires=True)[0]


CHAIN_COLUMNS = (turns.c.base_id, turns.c.whole_seq, turns.c.wire_parts, turns.c.request_parts)


def _contents(conn: Connection, rows: Sequence[Any], wires: bool) -> tuple[list[bytes], list[JsonObject]]:
    if not rows:
        return [], []
    chains: dict[str, tuple[str | None, bytes, bytes]] = {}
    for row in rows:
        if row.wire_parts is None:
            raise StorageError(f"turn {row.id} was not upgraded: restart trajproxy to finish the database's upgrade")
        if row.whole_seq is not None:
            chains[row.id] = (row.base_id, row.wire_parts, row.request_parts)
    pieced = [row for row in rows if row.whole_seq is not None]
    _bases(conn, pieced, chains)
    lists: dict[str, tuple[list[bytes], list[bytes]]] = {}
    for row in pieced:
        _lists(row.id, chains, lists)
    values = _pieces(conn, [lists[row.id] for row in pieced], wires)
    decoded: dict[bytes, Any] = {}
    wire_bodies: list[bytes] = []
    requests: list[JsonObject] = []
    for row in rows:
        if row.whole_seq is None:  # stored as it is
            if wires:
                wire_bodies.append(bytes(row.wire_parts))
            requests.append(orjson.loads(row.request_parts))
            continue
        wire, request = lists[row.id]
        for h in request:
            if h not in decoded:
                decoded[h] = orjson.loads(values[h])
        if wires:
            wire_bodies.append(b"".join([values[h] for h in wire]))
        requests.append(request_from(request, decoded))
    return wire_bodies, requests


def _bases(conn: Connection, rows: Sequence[Any], chains: dict[str, tuple[str | None, bytes, bytes]]) -> None:
    """Read the rows of the bases these turns' lists are written against, each chain in one range of its episode's
    seqs (from the turn whose lists are whole)."""
    spans: dict[str, tuple[int, int]] = {}
    for row in rows:
        if row.base_id is not None and row.base_id not in chains:
            low, high = spans.get(row.episode_id, (row.whole_seq, row.seq))
            spans[row.episode_id] = (min(low, row.whole_seq), max(high, row.seq))
    ranges = list(spans.items())
    for at in range(0, len(ranges), _AT_ONCE):
        within = [
            and_(turns.c.episode_id == episode_id, turns.c.seq >= low, turns.c.seq < high)
            for episode_id, (low, high) in ranges[at : at + _AT_ONCE]
        ]
        bases = select(turns.c.id, turns.c.base_id, *CHAIN_COLUMNS[1:]).where(or_(*within))
        for base in conn.execute(bases):
            if base.whole_seq is not None:  # a turn stored as it is is no one's base
                chains.setdefault(base.id, (base.base_id, base.wire_parts, base.request_parts))


def _lists(turn_id: str, chains: dict[str, tuple[str | None, bytes, bytes]], lists: dict[str, Any]) -> None:
    """Put a turn's lists of hashes together from its chain of bases (each turn's once)."""
    path: list[str] = []
    at: str | None = turn_id
    while at is not None and at not in lists:
        if at not in chains:
            raise StorageError(f"the database lacks turn {at}, on which turn {turn_id}'s content is written")
        path.append(at)
        at = chains[at][0]
    for step in reversed(path):
        base_id, wire_parts, request_parts = chains[step]
        base = lists[base_id] if base_id is not None else (None, None)
        lists[step] = (decode_parts(wire_parts, base[0]), decode_parts(request_parts, base[1]))


def _pieces(conn: Connection, needed: Sequence[tuple[list[bytes], list[bytes]]], wires: bool) -> dict[bytes, bytes]:
    """Every piece these turns' lists (wire body, request) name, each read once: the turns' own, not those of the
    bases their lists were read from, so that a page of an episode's turns reads about the page."""
    wanted = sorted({h for wire, request in needed for h in (*(wire if wires else ()), *request)})
    found: dict[bytes, bytes] = {}
    for at in range(0, len(wanted), _AT_ONCE):
        some = wanted[at : at + _AT_ONCE]
        for h, data in conn.execute(select(pieces.c.hash, pieces.c.data).where(pieces.c.hash.in_(some))):
            found[bytes(h)] = unpack(bytes(data))
    if len(found) < len(wanted):
        raise StorageError(f"the database lacks {len(wanted) - len(found)} piece(s) of turns' content")
    return found
