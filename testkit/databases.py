"""A Postgres schema of one's own: a fresh, empty database on a shared Postgres server, dropped afterwards."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

import sqlalchemy

from proxy.storage.engines import engine_url


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
