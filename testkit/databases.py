"""Databases for tests and benchmarks: a Postgres schema of one's own, and a finished run's SQLite file read back."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

import sqlalchemy

from proxy.core.values import Turn
from proxy.storage.content import turns
from proxy.storage.engines import engine_url
from proxy.storage.stored_turns import turns_of
from proxy.storage.tables import EpisodeRow


@contextlib.contextmanager
def fresh_schema(server_url: str) -> Iterator[str]:
    """A database URL whose tables live in a new, empty schema on the Postgres server, dropped afterwards."""
    schema = f"scratch_{secrets.token_hex(6)}"
    admin = sqlalchemy.create_engine(engine_url(server_url))
    try:
        with admin.begin() as conn:
            conn.execute(sqlalchemy.text(f"CREATE SCHEMA {schema}"))
        try:
            yield f"{server_url}{'&' if '?' in server_url else '?'}options=-csearch_path%3D{schema}"
        finally:
            with admin.begin() as conn:
                conn.execute(sqlalchemy.text(f"DROP SCHEMA {schema} CASCADE"))
    finally:
        admin.dispose()


def recorded_turns(database_url: str) -> list[Turn]:
    """Every turn a run's database holds, in order, read as trajproxy's store reads them: content and token ids put
    back together from their pieces and parents (a reply's row holds only its own ids)."""
    with _reading(database_url) as conn:
        return turns_of(conn, conn.execute(sqlalchemy.select(turns).order_by(turns.c.seq)).all())


def recorded_episodes(database_url: str) -> list[dict[str, str | None]]:
    """Each episode a run's database holds, oldest first: its id, status and the reason it ended (a failure's)."""
    table = EpisodeRow.__table__  # type: ignore[attr-defined]
    with _reading(database_url) as conn:
        rows = conn.execute(sqlalchemy.select(table.c.id, table.c.status, table.c.reason).order_by(table.c.created_at))
        return [{"id": row.id, "status": row.status, "reason": row.reason} for row in rows]


@contextlib.contextmanager
def _reading(database_url: str) -> Iterator[sqlalchemy.Connection]:
    engine = sqlalchemy.create_engine(engine_url(database_url))
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()
