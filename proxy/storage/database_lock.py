"""One process per database unless it is shared: trajproxy keeps its queue in memory, so two processes serving one
database would each hold half the truth (turns parked in one, replies posted to the other). The first to open a
SQLite file holds an exclusive lock on it (flock, apart from SQLite's own locks) for as long as it serves; on
Postgres, a session advisory lock keyed by the schema, taken exclusive by a lone process and shared by replicas
(`--shared`), so replicas exclude a lone process and it excludes them. A second is refused at start, with what to
do instead. Stores of one process share its hold. Readers (`trajproxy export`) take none."""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Any

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from proxy.core.errors import StorageError

_held: dict[str, tuple[int, int]] = {}  # database path -> (the locked file descriptor, how many stores hold it)
_sessions: dict[str, tuple[Any, int]] = {}  # Postgres URL -> (the session holding its lock, how many stores hold it)
_LOCK_SPACE = 0x7472616A  # "traj": the advisory locks' first key; the second is the schema's hash
_LOCK = "SELECT pg_try_advisory_lock{}(%s, hashtext(current_schema()))"


def driver_url(url: str) -> str:
    """A Postgres URL as psycopg itself takes it (no SQLAlchemy driver name), for connections of our own."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def database_url(url: str) -> URL:
    """`url` parsed; StorageError, in one line, for text that is not a database URL (never echoed: it may hold a
    password)."""
    try:
        return make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        raise StorageError(
            "the database URL is not one: expected sqlite:///PATH or postgresql://USER:PASSWORD@HOST/DATABASE"
        ) from None


def one_line(error: BaseException) -> str:
    """A driver's message, which may run over several lines, as one."""
    return " ".join(str(error).split())


class DatabaseLock:
    def __init__(self, url: str, *, shared: bool = False) -> None:
        parsed = database_url(url)
        memory = parsed.database in (None, "", ":memory:")
        self._path = None if parsed.get_backend_name() != "sqlite" or memory else parsed.database
        self._postgres = url if parsed.get_backend_name() in ("postgresql", "postgres") else None
        self._shared = shared
        self._holding: str | None = None  # the path this store holds
        self._locked: str | None = None  # the Postgres URL this store holds

    def acquire(self) -> None:
        """Take the database for this process; StorageError if another process serves it."""
        if self._postgres is not None:
            self._lock_postgres(self._postgres)
        if self._path is None or self._holding:
            return
        path = os.path.realpath(self._path)
        if path in _held:
            fd, holders = _held[path]
            _held[path] = (fd, holders + 1)
        else:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as e:
                raise StorageError(f"cannot open the SQLite database {self._path}: {e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise StorageError(
                    f"another trajproxy process is serving the SQLite database {self._path}: one process serves a "
                    "SQLite database; stop that one, or give this one another --database-url"
                ) from None
            _held[path] = (fd, 1)
        self._holding = path

    def _lock_postgres(self, url: str) -> None:
        if self._locked is not None:
            return
        if url in _sessions:
            session, holders = _sessions[url]
            _sessions[url] = (session, holders + 1)
            self._locked = url
            return
        import psycopg  # lazy: Postgres's driver; a server on SQLite never loads it

        where = make_url(url).render_as_string()
        try:
            session = psycopg.connect(driver_url(url), autocommit=True)
        except psycopg.Error as e:
            raise StorageError(f"cannot open the database at {where!r}: {one_line(e)}") from e
        try:
            taken = session.execute(_LOCK.format("_shared" if self._shared else ""), (_LOCK_SPACE,)).fetchone()
        except psycopg.Error as e:  # the session goes, not left open behind the error
            session.close()
            raise StorageError(f"cannot take trajproxy's lock on the database at {where!r}: {one_line(e)}") from e
        if not (taken and taken[0]):
            session.close()
            if self._shared:
                raise StorageError(
                    "a trajproxy process serves this Postgres database alone (started without --shared): stop it, "
                    "then start every replica with --shared"
                )
            raise StorageError(
                "another trajproxy process serves this Postgres database: one process serves it unless every "
                "one is started with --shared (replicas); stop it, start this one with --shared beside replicas, "
                "or give it another --database-url"
            )
        _sessions[url] = (session, 1)
        self._locked = url

    def release(self) -> None:
        if self._locked is not None:
            session, holders = _sessions.pop(self._locked)
            if holders > 1:
                _sessions[self._locked] = (session, holders - 1)
            else:
                with contextlib.suppress(Exception):
                    session.close()  # the lock goes with its session
            self._locked = None
        if self._holding is None:
            return
        fd, holders = _held.pop(self._holding)
        if holders > 1:
            _held[self._holding] = (fd, holders - 1)
        else:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the file lets go of its lock
        self._holding = None


def check_free(url: str, *, shared: bool = False) -> None:
    """Refuse, before anything starts, a database another process serves (StorageError saying so); the store
    takes the lock for real when it opens."""
    probe = DatabaseLock(url, shared=shared)
    probe.acquire()
    probe.release()
