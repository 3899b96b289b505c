"""A process killed while its Postgres connection runs a statement (an upgrade's batch, holding the upgrade's lock)
lets go of what it held within about a second, not once the statement ends: the next start does not wait for
the killed work."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy

from proxy.storage import upgrade
from proxy.storage.engines import engine_url
from tests.conftest import fresh_database
from tests.test_storage_upgrade import ROOT

STATEMENT_S = 120  # the killed statement's length; with the fix its lock goes about a second after the kill
HOLD = f"""
import asyncio, sys
from proxy.storage import upgrade
from proxy.storage.sql import SqlStore

async def main(url):
    store = SqlStore(url)
    await store.open()
    with store.engine.connect() as conn:  # a connection of the store's, as the upgrade's
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(upgrade._LOCK)
        conn.exec_driver_sql(f"SELECT pg_sleep({STATEMENT_S}) -- {{sys.argv[2]}}")  # the batch it is killed in

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.timeout(180)
def test_the_upgrade_lock_of_a_process_killed_mid_statement_is_free_long_before_the_statement_would_end(
    tmp_path: Path,
) -> None:
    with fresh_database("postgres", tmp_path) as schema_url:
        held_and_killed(schema_url)


def held_and_killed(schema_url: str) -> None:
    engine = sqlalchemy.create_engine(engine_url(schema_url))
    marker = secrets.token_hex(8)  # its statement's, told from another test's sleep on the same server
    held = subprocess.Popen(
        [sys.executable, "-c", HOLD, schema_url, marker], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    try:
        with engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            deadline = time.monotonic() + 120
            sleeping = sqlalchemy.text(
                "SELECT 1 FROM pg_stat_activity WHERE state = 'active' AND pid <> pg_backend_pid() AND query = :query"
            ).bindparams(query=f"SELECT pg_sleep({STATEMENT_S}) -- {marker}")
            while not conn.execute(sleeping).first():
                assert held.poll() is None and time.monotonic() < deadline, "the lock was never held"
                time.sleep(0.1)
            try_lock = upgrade._LOCK.replace("pg_advisory_lock", "pg_try_advisory_lock")
            assert conn.exec_driver_sql(try_lock).scalar() is False  # held by the sleeping statement

            os.kill(held.pid, signal.SIGKILL)
            held.wait(timeout=30)
            halfway = time.monotonic() + STATEMENT_S / 2  # well before the killed statement would have ended
            while not conn.exec_driver_sql(try_lock).scalar():
                assert time.monotonic() < halfway, "the lock was held as long as the killed statement would run"
                time.sleep(0.05)
            conn.exec_driver_sql(upgrade._UNLOCK)
    finally:
        if held.poll() is None:
            held.kill()
            held.wait(timeout=30)
        engine.dispose()
