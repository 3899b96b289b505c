"""A SQLite upgrade killed between the drop of the whole columns and the VACUUM: the next start vacuums the file,
giving back what the columns held, and the turns read as the previous code wrote them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import sqlalchemy
from sqlmodel import SQLModel

from proxy.storage import upgrade
from proxy.storage.engines import engine_url
from proxy.storage.sql import SqlStore
from proxy.storage.tables import add_missing_columns
from tests.test_storage_upgrade import ROOT, recorded_by_previous

KILLED_AT_VACUUM = """
import os, sys
import sqlalchemy
from sqlalchemy import event
from sqlalchemy.engine import Engine
from proxy.storage import upgrade

@event.listens_for(Engine, "before_cursor_execute")
def killed(conn, cursor, statement, *rest):
    if statement.strip().upper() == "VACUUM":
        os._exit(9)  # as a kill at that point: nothing after it runs

upgrade.upgrade(sqlalchemy.create_engine(sys.argv[1]))
"""


def test_an_upgrade_killed_before_its_vacuum_is_vacuumed_at_the_next_start(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/trajproxy.db"
    before = recorded_by_previous(url, tmp_path)
    engine = sqlalchemy.create_engine(engine_url(url))
    try:
        with engine.begin() as conn:  # the new tables and columns, as opening the store adds them first
            SQLModel.metadata.create_all(conn)
            add_missing_columns(conn)
    finally:
        engine.dispose()
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AT_VACUUM, engine_url(url)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert killed.returncode == 9, killed.stderr.decode()[-2000:]
    file = tmp_path / "trajproxy.db"
    unvacuumed = file.stat().st_size

    async def read() -> None:  # the next start: the store opens (and upgrades) the database
        store = SqlStore(url)
        await store.open()
        try:
            for episode_id, turns in before.items():
                assert await store.turns(episode_id) == turns
        finally:
            await store.close()

    asyncio.run(read())
    assert file.stat().st_size < unvacuumed / 2, f"{file.stat().st_size} bytes against {unvacuumed} before"
    engine = sqlalchemy.create_engine(engine_url(url))
    try:
        assert not upgrade.needed(engine)
        with engine.connect() as conn:
            assert not sqlalchemy.inspect(conn).has_table(upgrade._OWED)
    finally:
        engine.dispose()
