"""The upgrade of a database the previous schema wrote (turns holding their wire body and request whole): the
previous release's code (its `proxy` package, from git) records conversations of every dialect and reads them
back; this version upgrades the database on open, in batches, resuming one stopped midway, and reads every turn
back field for field as the previous code did."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import sqlalchemy
from rich.console import Console
from sqlmodel import SQLModel

from proxy.core.values import Turn
from proxy.storage import upgrade
from proxy.storage.engines import engine_url
from proxy.storage.sql import SqlStore
from proxy.storage.tables import add_missing_columns
from tests.test_storage_pieces import PARSERS, conversation

ROOT = Path(__file__).resolve().parent.parent
PREVIOUS = "3cf3c33"  # the last commit whose turns hold their wire body and request whole

RECORD = """
import asyncio, base64, pickle, sys
from dataclasses import replace
import orjson
from proxy.core.keys import hash_key, new_id, new_key  # the previous commit's module
from proxy.core.values import Episode, EpisodeStatus, Reply, Turn, TurnStatus, Usage
from proxy.storage.sql import SqlStore

async def main(url, calls_file, out_file):
    store = SqlStore(url)
    await store.open()
    read = {}
    for episode_calls in orjson.loads(open(calls_file, "rb").read()):
        episode = Episode(new_id("ep"), hash_key(new_key()), "t", {}, EpisodeStatus.RUNNING, 1.0)
        await store.add_episode(episode)
        for seq, call in enumerate(episode_calls):
            turn = Turn(new_id("tu"), episode.id, seq, call["dialect"], call["request"],
                        base64.b64decode(call["wire"]), seq % 2 == 0, TurnStatus.PARKED, 2.0 + seq, model="policy",
                        branch=seq % 3 // 2)
            await store.add_turn(turn)
            if seq % 5:
                reply = Reply({"role": "assistant", "content": f"re {seq}"}, "stop", Usage(3, 4),
                              prompt_token_ids=(1, 2), completion_token_ids=(3,), logprobs=(-0.5,))
                await store.save_turns([replace(turn, status=TurnStatus.ANSWERED, reply=reply, answered_at=3.0)])
        read[episode.id] = await store.turns(episode.id)
    await store.close()
    open(out_file, "wb").write(pickle.dumps(read))

asyncio.run(main(*sys.argv[1:]))
"""


def previous_package(folder: Path, commit: str = PREVIOUS) -> Path:
    """The `proxy` package of a previous commit (by default the previous release's), unpacked from git into
    `folder`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "proxy"], capture_output=True, check=False, timeout=60
    )
    if archive.returncode != 0:
        pytest.skip(f"git cannot give commit {commit}'s files (a shallow clone?): {archive.stderr.decode()[:200]}")
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True, timeout=60)
    return folder


def recorded_by_previous(url: str, tmp_path: Path) -> dict[str, list[Turn]]:
    """Conversations of every dialect (more turns than a batch of the upgrade), recorded by the previous code;
    what it read back, by episode."""
    calls = [
        [{"dialect": d, "wire": base64.b64encode(wire).decode(), "request": request} for wire, request in made]
        for n, d in enumerate(sorted(PARSERS))
        for made in [conversation(d, 70, seed=n)]
    ]
    (tmp_path / "calls.json").write_bytes(orjson.dumps(calls))
    (tmp_path / "record.py").write_text(RECORD)
    old = previous_package(tmp_path / "previous")
    env = {**os.environ, "PYTHONPATH": str(old)}
    args = [sys.executable, str(tmp_path / "record.py"), url, str(tmp_path / "calls.json"), str(tmp_path / "out")]
    subprocess.run(args, check=True, env=env, cwd=tmp_path, timeout=300)
    read: dict[str, list[Turn]] = pickle.loads((tmp_path / "out").read_bytes())
    return read


def test_an_upgraded_database_reads_as_before(database_url: str, tmp_path: Path) -> None:
    before = recorded_by_previous(database_url, tmp_path)
    assert sum(len(turns) for turns in before.values()) > upgrade.BATCH
    engine = sqlalchemy.create_engine(engine_url(database_url))
    try:
        assert upgrade.needed(engine)
        with engine.begin() as conn:  # the new tables and columns, as opening the store adds them first
            SQLModel.metadata.create_all(conn)
            add_missing_columns(conn)
        # one batch only, as if the upgrade had been stopped there
        batches = upgrade._batches(engine)
        assert next(batches) == upgrade.BATCH
        batches.close()
        said = io.StringIO()
        assert upgrade.upgrade(engine, Console(file=said, width=100)) == sum(map(len, before.values())) - upgrade.BATCH
        assert "upgrading the database" in said.getvalue()
        assert not upgrade.needed(engine)
    finally:
        engine.dispose()

    async def read() -> None:
        store = SqlStore(database_url)
        await store.open()
        try:
            for episode_id, turns in before.items():
                after = await store.turns(episode_id)
                assert len(after) == len(turns)
                for old, new in zip(turns, after, strict=True):
                    assert new == old, old.id
                    assert new.wire == old.wire and list(new.request) == list(old.request)
                for turn in turns[::7]:
                    assert await store.turn(turn.id) == turn
        finally:
            await store.close()

    asyncio.run(read())
