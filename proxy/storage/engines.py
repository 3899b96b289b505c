"""How trajproxy connects to its database: the URL as SQLAlchemy takes it, and the settings of each SQLite
connection."""

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
