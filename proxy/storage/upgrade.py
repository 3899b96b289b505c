"""The upgrade of a database whose turns hold their wire body and request whole (the `wire` and `request` columns
of trajproxy 0.x before pieces): on start, before serving, each turn's content is cut into pieces
(`proxy.storage.pieces`) and its columns emptied, a batch of turns per transaction, so an upgrade stopped midway
goes on where it stopped at the next start; once every turn is done the two columns are dropped (and a SQLite file
vacuumed, giving back what they held: a table left beside the drop, in its transaction, says the VACUUM is owed until
it is done, so that one stopped before it is done at the next start). A progress bar says how far it is, on the
terminal's standard error.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import orjson
from sqlalchemy import Engine, bindparam, inspect, text, update

from proxy.storage.content import CHAIN, insert_pieces, turns
from proxy.storage.pieces import cut, encode_parts, pack
from proxy.storage.tables import missing_columns

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

log = logging.getLogger("trajproxy.storage")

BATCH = 200  # turns per transaction
_LOCK = "SELECT pg_advisory_lock(1953653100, hashtext(current_schema()))"  # one replica upgrades; the rest wait
_UNLOCK = "SELECT pg_advisory_unlock(1953653100, hashtext(current_schema()))"
_LEFT = text("SELECT count(*) FROM turn WHERE wire_parts IS NULL")
_NEXT = text(
    "SELECT id, episode_id, seq, wire, CAST(request AS TEXT) AS request FROM turn WHERE wire_parts IS NULL "
    "AND (episode_id > :episode_id OR (episode_id = :episode_id AND seq > :seq)) ORDER BY episode_id, seq LIMIT :n"
)
_DONE = (
    update(turns)
    .where(turns.c.id == bindparam("u_id"))
    .values(
        base_id=bindparam("u_base_id"),
        whole_seq=bindparam("u_whole_seq"),
        wire_parts=bindparam("u_wire_parts"),
        request_parts=bindparam("u_request_parts"),
    )
)
_EMPTIED = text("UPDATE turn SET wire = :nothing, request = '{}' WHERE id = :id")


def needed(engine: Engine) -> bool:
    with engine.connect() as conn:
        return "wire" in {column["name"] for column in inspect(conn).get_columns("turn")}


def outdated(engine: Engine) -> bool:
    """Whether an older trajproxy wrote the database and none since has opened it to serve: tables or columns it
    lacks, or turns held whole; a store's `open` brings it up to date, and until then the new code cannot read it."""
    with engine.connect() as conn:
        if missing_columns(conn):
            return True
    return needed(engine)


_OWED = "upgrade_vacuum_owed"  # a table there while a SQLite file still holds the dropped columns' pages


def upgrade(engine: Engine, console: Console | None = None) -> int:
    """Store every turn's content as pieces, if the database holds it whole; the turns upgraded."""
    if not needed(engine):
        _vacuum_if_owed(engine)  # an upgrade stopped between the drop and the VACUUM
        return 0
    with _locked(engine):
        if not needed(engine):  # another replica upgraded it while this one waited
            return 0
        with engine.connect() as conn:
            left = int(conn.execute(_LEFT).scalar_one())
        log.info("upgrading the database: %d turns' content to pieces", left)
        done = 0
        with _progress(console) as progress:
            task = progress.add_task("upgrading the database", total=left)
            for count in _batches(engine):
                done += count
                progress.advance(task, count)
        _drop_whole_columns(engine)
        log.info("upgraded the database: %d turns", done)
        return done


def _batches(engine: Engine) -> Generator[int, None, None]:
    """Upgrade the turns left, a batch per transaction; yields each batch's size."""
    insert = insert_pieces(engine.dialect.name)
    known: set[bytes] = set()
    last: tuple[str, str, int, int, list[bytes], list[bytes]] | None = None  # episode, turn, whole seq, depth, lists
    after: dict[str, Any] = {"episode_id": "", "seq": -1}
    while True:
        with engine.begin() as conn:
            rows = conn.execute(_NEXT, {**after, "n": BATCH}).all()
            if not rows:
                return
            new: dict[bytes, bytes] = {}
            done: list[dict[str, Any]] = []
            for row in rows:
                request = orjson.loads(row.request)
                pieces = cut(bytes(row.wire), request)
                wire_list, request_list, data = pieces.wire, pieces.request, pieces.data
                new.update((h, piece) for h, piece in data.items() if h not in known)
                if last is not None and last[0] == row.episode_id and last[3] + 1 < CHAIN:
                    base_id, whole_seq, depth = last[1], last[2], last[3] + 1
                    wire_parts, request_parts = encode_parts(wire_list, last[4]), encode_parts(request_list, last[5])
                else:
                    base_id, whole_seq, depth = None, row.seq, 0
                    wire_parts, request_parts = encode_parts(wire_list, None), encode_parts(request_list, None)
                last = (row.episode_id, row.id, whole_seq, depth, wire_list, request_list)
                done.append(
                    {
                        "u_id": row.id,
                        "u_base_id": base_id,
                        "u_whole_seq": whole_seq,
                        "u_wire_parts": wire_parts,
                        "u_request_parts": request_parts,
                    }
                )
            if new:
                conn.execute(insert, [{"hash": h, "data": pack(new[h])} for h in sorted(new)])
            conn.execute(_DONE, done)
            conn.execute(_EMPTIED, [{"id": row.id, "nothing": b""} for row in rows])
        known.update(new)
        if len(known) > 1 << 18:
            known.clear()
        after = {"episode_id": rows[-1].episode_id, "seq": rows[-1].seq}
        yield len(rows)


def _drop_whole_columns(engine: Engine) -> None:
    sqlite = engine.dialect.name == "sqlite"
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE turn DROP COLUMN wire"))
        conn.execute(text("ALTER TABLE turn DROP COLUMN request"))
        if sqlite:  # the file keeps the pages the columns held until it is vacuumed
            conn.execute(text(f"CREATE TABLE {_OWED} (id INTEGER)"))
    _vacuum_if_owed(engine)


def _vacuum_if_owed(engine: Engine) -> None:
    """Vacuum a SQLite file whose dropped columns' pages are not given back yet, then say it is done."""
    if engine.dialect.name != "sqlite":
        return
    with engine.connect() as conn:
        if not inspect(conn).has_table(_OWED):
            return
    log.info("vacuuming the database: giving back what the upgrade's dropped columns held")
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM")
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {_OWED}"))


@contextmanager
def _locked(engine: Engine) -> Iterator[None]:
    if engine.dialect.name != "postgresql":
        yield  # a SQLite database is served by one process (`proxy.storage.database_lock`)
        return
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(_LOCK)
        try:
            yield
        finally:
            conn.exec_driver_sql(_UNLOCK)


def _progress(console: Console | None) -> Progress:
    # lazy: rich, loaded only where a database needs upgrading (not by every server's start-up)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("turns"),
        TimeRemainingColumn(),
        console=console or Console(stderr=True),
    )
