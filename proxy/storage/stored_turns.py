"""Turns read back from their rows: their wire bodies and requests put back together from their pieces
(`proxy.storage.content`), their replies' token ids from their chains of parents (`proxy.storage.token_ids`)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import orjson
from sqlalchemy import Connection, and_, or_, select

from proxy.core.errors import StorageError
from proxy.core.values import JsonObject, Turn
from proxy.storage.content import pieces, turn_from, turns
from proxy.storage.pieces import decode_parts, request_from, unpack
from proxy.storage.token_ids import Ids, chain_of, ids_of

_AT_ONCE = 500  # hashes or ranges in one SELECT (under SQLite's and Postgres's limits on parameters)


def turns_of(conn: Connection, rows: Sequence[Any]) -> list[Turn]:
    """The turns these rows (all of `turn`'s columns) hold, their wire bodies and requests put back together."""
    wires, requests = _contents(conn, rows, wires=True)
    ids = _ids(conn, rows)
    return [
        turn_from(row, wire, request, ids.get(row.id)) for row, wire, request in zip(rows, wires, requests, strict=True)
    ]


def with_requests(conn: Connection, rows: Sequence[Any]) -> list[SimpleNamespace]:
    """These rows (of `turn`'s columns, with `CHAIN_COLUMNS`), each with its request put back together as `request`
    (not its wire body, which is not read), and its reply's ids in its JSON (`prompt_token_ids`,
    `completion_token_ids`)."""
    _, requests = _contents(conn, rows, wires=False)
    ids = _ids(conn, rows)
    read = []
    for row, request in zip(rows, requests, strict=True):
        fields = {**row._mapping, "request": request}
        if (found := ids.get(row.id)) is not None:
            fields["reply"] = {
                **row.reply,
                "prompt_token_ids": _list(found[0]),
                "completion_token_ids": _list(found[1]),
            }
        read.append(SimpleNamespace(**fields))
    return read


def _ids(conn: Connection, rows: Sequence[Any]) -> dict[str, Ids]:
    """The rows' replies' ids, where any has them (`proxy.storage.token_ids`)."""
    if not any(row.token_ids is not None or (row.reply and "completion_token_ids" in row.reply) for row in rows):
        return {}
    return ids_of(conn, rows)


def wire_bodies(conn: Connection, rows: Sequence[Any]) -> list[bytes]:
    """The wire bodies of these rows (with `id`, `episode_id`, `seq` and `CHAIN_COLUMNS`)."""
    return _contents(conn, rows, wires=True)[0]


CHAIN_COLUMNS = (turns.c.base_id, turns.c.whole_seq, turns.c.wire_parts, turns.c.request_parts)
ID_COLUMNS = (turns.c.parent_id, turns.c.token_ids)  # what `with_requests` reads the replies' ids from


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
    for step in reversed(chain_of(turn_id, chains, lambda at: chains[at][0], lists, "content")):
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


def _list(ids: tuple[int, ...] | None) -> list[int] | None:
    return list(ids) if ids is not None else None
