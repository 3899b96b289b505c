"""How trajproxy connects to its database: the URL as SQLAlchemy takes it, and the settings of each SQLite and
Postgres connection."""

from __future__ import annotations

from typing import Any


def engine_url(url: str) -> str:
    """Accept plain `postgresql://` URLs and route them to the psycopg 3 driver."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def tune_sqlite(dbapi_connection: Any, _record: Any) -> None:
    """Each SQLite connection: write-ahead log, foreign keys, and a wait of its own for a busy database."""
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


CHECK_CLIENT_MS = 1000  # how often a Postgres backend busy with a statement looks whether its client is still there


def tune_postgres(dbapi_connection: Any, _record: Any) -> None:
    """Each Postgres connection: its backend notices within a second that the process behind it died, even in the
    middle of a statement (Postgres 14 and later), so what it held (an upgrade's lock, a batch's rows) is let go
    then, not once the statement ends: a start after a kill waits that long at most, not for the killed work."""
    cursor = dbapi_connection.cursor()
    cursor.execute("SHOW server_version_num")
    if int(cursor.fetchone()[0]) >= 140000:
        cursor.execute(f"SET client_connection_check_interval = {CHECK_CLIENT_MS}")
    cursor.close()
    dbapi_connection.commit()  # a setting made in a transaction the pool rolls back would go with it
