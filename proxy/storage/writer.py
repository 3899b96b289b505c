"""The group-commit writer: one thread takes every write queued while the previous commit ran and commits them as
one transaction, so many turns share one fsync; each write's future resolves only once its transaction has
committed. Writes are data (a prebuilt statement and its rows), so a run of writes with one statement (many
agents' turns parked at once) executes as one executemany. A batch that fails is retried write by write, so one
bad write fails alone and the writer lives on; one that fails on a key taken first (shared mode) is retried as one
transaction with a savepoint per write, so the others still share a commit.

A write may be deferred (`Deferred`): its statements are built on this thread when its batch commits (a new turn is
cut into pieces here, not on the serving loop), some to run before every other write of the batch (pieces, which
nothing else refers to until the turn that names them is written), and it is told once it has committed."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from itertools import groupby
from typing import Any, Protocol

from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.expression import Executable

from proxy.core.errors import Stale, StorageError

log = logging.getLogger("trajproxy.storage")

Op = tuple[Executable, list[dict[str, Any]]]  # a statement and the rows it writes


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
            with self._engine.begin() as conn:
                for statement, rows in _runs([first for firsts, _ in built for first in firsts]):
                    conn.execute(statement, rows)
                for statement, rows in _runs([op for _, main in built for op in main]):
                    conn.execute(statement, rows)
            for op in ops:
                if not isinstance(op, tuple):
                    op.committed()
            return [None] * len(ops)
        except Exception as e:  # the driver's own errors (e.g. encoding) are not all SQLAlchemy's
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
        with self._engine.begin() as conn:
            for statement, rows in _runs([first for firsts, _ in built for first in firsts]):
                conn.execute(statement, rows)
            for _, main in built:
                try:
                    with conn.begin_nested():
                        for statement, rows in main:
                            conn.execute(statement, rows)
                    outcomes.append(None)
                except IntegrityError as e:  # any other error fails the batch: each write is then tried alone
                    outcomes.append(Stale(f"the database already holds this record: {type(e.orig).__name__}"))
        for op, outcome in zip(ops, outcomes, strict=True):
            if outcome is None and not isinstance(op, tuple):
                op.committed()
        return outcomes


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
