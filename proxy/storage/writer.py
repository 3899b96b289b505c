"""The store's writes (`StoreWrites`, which `SqlStore` is): each a prebuilt statement and its rows, committed by the
group-commit writer (`Writer`). One thread takes every write queued while the previous commit ran and commits them as
one transaction, so many turns share one fsync; each write's future resolves only once its transaction has committed.
Writes are data (a prebuilt statement and its rows), so a run of writes with one statement (many agents' turns parked
at once) executes as one executemany. A batch that fails is retried write by write, so one bad write fails alone and
the writer lives on; one that fails on a key taken first (shared mode) is retried as one transaction with a savepoint
per write, so the others still share a commit.

A write may be deferred (`Deferred`): its statements are built on this thread when its batch commits (a new turn is
cut into pieces here, not on the serving loop), some to run before every other write of the batch (pieces, which
nothing else refers to until the turn that names them is written), and it is told once it has committed."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from itertools import groupby
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, Table, bindparam, insert, update
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.sql.expression import Executable

from proxy.core.errors import Stale, StorageError
from proxy.core.values import Episode, EpisodeStatus, Reward, Turn, TurnStatus
from proxy.storage.content import TURN_SETTLED, TURN_STATE, Contents
from proxy.storage.prepared import Prepared
from proxy.storage.tables import EpisodeRow, Op, RewardRow, TurnRow, episode_row, reward_row

log = logging.getLogger("trajproxy.storage")


class Deferred(Protocol):
    def ops(self) -> tuple[list[Op], list[Op]]:
        """The writes to run first in the batch, and the write itself (built on the writer thread)."""
        ...

    def committed(self) -> None:
        """Its transaction committed (on the writer thread)."""
        ...


Write = Op | Deferred
_MAX_BATCH = 1024


class Writer:
    def __init__(self, engine: Engine, on_commit: Callable[[int, float], None] | None = None) -> None:
        self._engine = engine
        self._on_commit = on_commit  # told each transaction's writes and seconds (from the writer thread)
        self._prepared = Prepared(engine.dialect)
        self._conn: Connection | None = None  # the writer thread's own, held from batch to batch
        self._loop = asyncio.get_running_loop()
        self._queue: queue.SimpleQueue[tuple[Write, asyncio.Future[None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="trajproxy-writer", daemon=True)
        self._thread.start()

    def write(self, op: Write) -> asyncio.Future[None]:
        """Queue a write; the future resolves once its transaction has committed (or fails with why not)."""
        future = self._loop.create_future()
        self._queue.put((op, future))
        return future

    async def stop(self) -> None:
        """Commit what is queued, then end the thread."""
        self._queue.put(None)
        await asyncio.to_thread(self._thread.join)

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self._let_go()

    def _serve(self) -> None:
        stopping = False
        while not stopping:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < _MAX_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                batch.append(item)
            began = time.perf_counter()
            try:
                outcomes = self._commit([op for op, _ in batch])
                if self._on_commit is not None:
                    self._on_commit(len(batch), time.perf_counter() - began)
            except Exception as e:  # never let the writer die: every later write would hang
                log.exception("database writer failed a batch")
                outcomes = [StorageError(f"the database could not record this change: {e}")] * len(batch)
            self._loop.call_soon_threadsafe(_settle, [future for _, future in batch], outcomes)

    def _commit(self, ops: list[Write]) -> list[BaseException | None]:
        """Commit the batch as one transaction; if it fails, retry each write alone to isolate the bad one."""
        try:
            built = [_built(op) for op in ops]

            def statements(conn: Connection) -> None:
                for statement, rows in _runs([first for firsts, _ in built for first in firsts]):
                    self._prepared.execute(conn, statement, rows)
                for statement, rows in _runs([op for _, main in built for op in main]):
                    self._prepared.execute(conn, statement, rows)

            self._transaction(statements)
            for op in ops:
                if not isinstance(op, tuple):
                    op.committed()
            return [None] * len(ops)
        except Exception as e:  # the driver's own errors (e.g. encoding) are not all SQLAlchemy's
            if (isinstance(e, DBAPIError) and e.connection_invalidated) or (self._conn and self._conn.invalidated):
                self._let_go(invalidate=True)  # (any other failure rolled its transaction back: the connection is fine)
            if len(ops) == 1 and isinstance(e, IntegrityError):  # a key another replica took first: theirs stands
                return [Stale(f"the database already holds this record: {type(e.orig).__name__}")]
            if len(ops) == 1:
                log.exception("database write failed")
                return [StorageError(f"the database could not record this change: {type(e).__name__}")]
            if isinstance(e, IntegrityError) and self._engine.dialect.name == "postgresql":
                try:
                    return self._each_saved(ops)
                except Exception as again:  # another write failed too: writing each alone, below, finds which
                    log.warning("a batch failed again under savepoints (%s); writing each alone", type(again).__name__)
        return [self._commit([op])[0] for op in ops]

    def _each_saved(self, ops: list[Write]) -> list[BaseException | None]:
        """The batch again as one transaction, each write under a savepoint: a key another replica took first
        (shared mode, where an agent's calls land on two replicas) fails its write alone, and the others still
        share one commit. Each write in a transaction of its own would cost a commit (an fsync) apiece, and every
        write queued behind them (all this replica's new turns) would wait on those commits."""
        outcomes: list[BaseException | None] = []
        built = [_built(op) for op in ops]

        def statements(conn: Connection) -> None:
            outcomes.clear()
            for statement, rows in _runs([first for firsts, _ in built for first in firsts]):
                self._prepared.execute(conn, statement, rows)
            for _, main in built:
                try:
                    with conn.begin_nested():
                        for statement, rows in main:
                            self._prepared.execute(conn, statement, rows)
                    outcomes.append(None)
                except IntegrityError as e:  # any other error fails the batch: each write is then tried alone
                    outcomes.append(Stale(f"the database already holds this record: {type(e.orig).__name__}"))

        self._transaction(statements)
        for op, outcome in zip(ops, outcomes, strict=True):
            if outcome is None and not isinstance(op, tuple):
                op.committed()
        return outcomes

    def _transaction(self, statements: Callable[[Connection], None]) -> None:
        """Run the statements in one transaction on the held connection. One found dead before the commit (the
        database restarted, or dropped it, since the last batch: the pool's pre-ping used to find that at each
        checkout) is dropped, and the transaction runs once more on a fresh one: nothing of it was committed."""
        for last in (False, True):
            conn = self._connection()
            ran = False
            try:
                with conn.begin():
                    statements(conn)
                    ran = True
            except DBAPIError as e:
                if ran or last or not e.connection_invalidated:
                    raise
                log.warning("the database dropped the writer's connection; writing again on a new one")
                self._let_go(invalidate=True)
            else:
                return

    def _connection(self) -> Connection:
        """The writer thread's connection, checked out of the pool once and held: checking one out and in again
        for every batch cost as much as the statements."""
        if self._conn is None:
            self._conn = self._engine.connect()
        return self._conn

    def _let_go(self, invalidate: bool = False) -> None:
        """Give the held connection back (at the end), or drop it (after a failure: the next batch checks out
        another, which the pool tests first where it is told to)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if invalidate:
                conn.invalidate()
            conn.close()
        except Exception:  # a dead connection's close can fail too; it is gone either way
            log.debug("the writer's connection could not be closed", exc_info=True)


def _built(op: Write) -> tuple[list[Op], list[Op]]:
    return ([], [op]) if isinstance(op, tuple) else op.ops()


def _runs(ops: list[Op]) -> Iterator[Op]:
    """Adjacent writes with the same statement, as one write of all their rows (order kept)."""
    for _, run in groupby(ops, key=lambda op: id(op[0])):  # statements are built once: identity is equality
        writes = list(run)
        yield writes[0][0], [row for _, rows in writes for row in rows]


def _settle(futures: list[asyncio.Future[None]], outcomes: list[BaseException | None]) -> None:
    for future, outcome in zip(futures, outcomes, strict=True):
        if future.done():
            continue
        if outcome is None:
            future.set_result(None)
        else:
            future.set_exception(outcome)


# The store's writes

episodes = EpisodeRow.__table__  # type: ignore[attr-defined]
turns = TurnRow.__table__  # type: ignore[attr-defined]
rewards = RewardRow.__table__  # type: ignore[attr-defined]


def _updater(table: Table, columns: Sequence[str]) -> Executable:
    """UPDATE table SET columns WHERE id = :s_id, its values bound as s_<column> (`_bound` rows)."""
    values: dict[str, Any] = {column: bindparam(f"s_{column}") for column in columns if column != "id"}
    return update(table).where(table.c.id == bindparam("s_id")).values(values)


def _bound(row: dict[str, Any]) -> dict[str, Any]:
    return {f"s_{key}": value for key, value in row.items()}


# Built once: constructing a statement costs more than executing it.
_ADD_EPISODE = insert(episodes)
_SAVE_EPISODE = _updater(episodes, [column.name for column in episodes.columns])
_ADD_TURN = insert(turns)
_SAVE_TURN = _updater(turns, TURN_STATE)
_ADD_REWARD = insert(rewards)
# Shared mode: a replica settles only the open turns it holds (another may have answered one, or taken it over);
# leases are the database's, not its own; and no replica's stale copy of an episode reopens a closed one.
_OPEN = [TurnStatus.PARKED.value, TurnStatus.LEASED.value]
_CLOSED = [status.value for status in EpisodeStatus if status.closed]
_SAVE_TURN_SHARED = (
    update(turns)
    .where(turns.c.id == bindparam("s_id"), turns.c.status.in_(_OPEN), turns.c.replica == bindparam("s_me"))
    .values({column: bindparam(f"s_{column}") for column in TURN_SETTLED})
)
_SAVE_EPISODE_SHARED = (
    update(episodes)
    .where(episodes.c.id == bindparam("s_id"), episodes.c.status.not_in(_CLOSED))
    .values({column.name: bindparam(f"s_{column.name}") for column in episodes.columns if column.name != "id"})
)


class StoreWrites:
    """The `Store`'s writes (`SqlStore`'s), each a prebuilt statement and its rows queued to the writer thread."""

    replica: str | None  # this replica's id, when it is one of several sharing a Postgres database
    _writer: Writer | None
    _contents: Contents | None  # what the writer thread knows of the pieces it wrote

    def add_episode(self, episode: Episode) -> Awaitable[None]:
        return self._write((_ADD_EPISODE, [episode_row(episode)]))

    def save_episode(self, episode: Episode) -> Awaitable[None]:
        statement = _SAVE_EPISODE if self.replica is None else _SAVE_EPISODE_SHARED
        return self._write((statement, [_bound(episode_row(episode))]))

    def add_turn(self, turn: Turn) -> Awaitable[None]:
        return self._write(self.contents.write(turn, _ADD_TURN, _as_is))

    @property
    def contents(self) -> Contents:
        """The pieces' bookkeeping of the writer thread, for writes of new turns (`proxy.storage.content`)."""
        assert self._contents is not None, "SqlStore.open() was not awaited"
        return self._contents

    def save_turns(self, batch: Sequence[Turn]) -> Awaitable[None]:
        if not batch:
            return _done()
        if self.replica is not None:
            me = self.replica
            return self._write(self.contents.save(batch, _SAVE_TURN_SHARED, lambda row: {**_bound(row), "s_me": me}))
        return self._write(self.contents.save(batch, _SAVE_TURN, _bound))

    def add_reward(self, reward: Reward) -> Awaitable[None]:
        return self._write((_ADD_REWARD, [reward_row(reward)]))

    def _write(self, op: Write) -> asyncio.Future[None]:
        assert self._writer is not None, "SqlStore.open() was not awaited"
        return self._writer.write(op)

    write = _write  # for the shared queue's writes, group-committed with the rest (`proxy.storage.postgres_queue`)


def _as_is(row: dict[str, Any]) -> dict[str, Any]:
    return row


def _done() -> asyncio.Future[None]:
    future = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future
