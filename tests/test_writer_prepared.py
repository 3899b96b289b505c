"""The writer's statements run on the driver's cursor (`proxy.storage.prepared`): the database holds exactly what
`Connection.execute` would have written, a key taken first is still SQLAlchemy's `IntegrityError`, and the
writer's held connection, dropped by the database between writes, is replaced without failing the next write."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy.exc import IntegrityError

from proxy.core.values import EpisodeStatus, Reward, TurnStatus
from proxy.storage import writer
from proxy.storage.content import INLINE_BELOW, insert_pieces
from proxy.storage.prepared import Prepared
from proxy.storage.sql import SqlStore
from tests.test_store import METADATA, T0, episode_value, full_reply, opened, turn_value

WAIT_S = 10
TABLES = ("episode", "turn", "piece", "reward")


def run(body: Coroutine[Any, Any, None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(WAIT_S * 3):
            await body

    asyncio.run(bounded())


async def some_writes(store: SqlStore) -> None:
    """Every kind of write the store makes in a turn's life: an episode, turns small and cut into pieces, their
    answers with ids, the episode's update, a reward; with non-ASCII text, NULLs, booleans and bytes."""
    episode = episode_value(id="ep_prepared", key_hash="k" * 64, metadata=METADATA)
    await store.add_episode(episode)
    big = {"model": "policy", "messages": [{"role": "user", "content": "é" * INLINE_BELOW}]}
    small = turn_value(episode.id, 0, id="tu_small")
    large = turn_value(episode.id, 1, id="tu_large", request=big, wire=repr(big).encode(), parent_id="tu_small")
    await store.add_turn(small)
    await store.add_turn(large)
    answered = [
        replace(turn, status=TurnStatus.ANSWERED, reply=full_reply(), deliveries=1, answered_at=T0 + 2)
        for turn in (small, large)
    ]
    await store.save_turns(answered)
    await store.save_episode(replace(episode, status=EpisodeStatus.FINISHED, ended_at=T0 + 3, reason="ошибка ✓"))
    await store.add_reward(Reward("rw_prepared", episode.id, "reward", 0.5, "grader", T0 + 4, info={"why": None}))


def rows(engine: sqlalchemy.Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every table's rows as the database holds them (JSON as its text, bytes as bytes)."""
    with engine.connect() as conn:
        return {
            table: sorted(
                tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)
                for row in conn.exec_driver_sql(f"SELECT * FROM {table}")
            )
            for table in TABLES
        }


async def written(database_url: str) -> dict[str, list[tuple[Any, ...]]]:
    """What `some_writes` leaves in the database, which it then empties."""
    async with opened(lambda: SqlStore(database_url)) as store:
        await some_writes(store)
        assert store._engine is not None
        held = rows(store._engine)
        with store._engine.begin() as conn:
            for table in reversed(TABLES):
                conn.exec_driver_sql(f"DELETE FROM {table}")
        return held


def test_the_database_holds_what_connection_execute_would_have_written(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        prepared = await written(database_url)
        monkeypatch.setattr(Prepared, "_for", lambda self, statement, keys: None)  # every statement as before
        assert prepared == await written(database_url)
        assert all(prepared[table] for table in TABLES)

    run(body())


def test_the_store_s_writes_are_compiled_once_not_run_through_connection_execute(database_url: str) -> None:
    async def body() -> None:
        async with opened(lambda: SqlStore(database_url)) as store:
            assert store._engine is not None
            prepared = Prepared(store._engine.dialect)
            turn_row = {column.name: None for column in writer.turns.columns}
            for statement, row in [
                (writer._ADD_TURN, turn_row),
                (writer._SAVE_TURN, writer._bound({"id": "x", "status": "answered"})),
                (insert_pieces(store._engine.dialect.name), {"hash": b"h", "data": b"d"}),
                (writer._ADD_REWARD, {"id": "r", "value": 1.0}),
            ]:
                assert prepared._for(statement, tuple(row)) is not None, statement

    run(body())


def test_a_key_taken_first_is_sqlalchemy_s_integrity_error_and_the_turn_stale(database_url: str) -> None:
    async def body() -> None:
        async with opened(lambda: SqlStore(database_url)) as store:
            episode = episode_value()
            await store.add_episode(episode)
            assert store._engine is not None
            prepared = Prepared(store._engine.dialect)
            with store._engine.connect() as conn, pytest.raises(IntegrityError):
                prepared.execute(conn, writer._ADD_EPISODE, [{"id": episode.id, "key_hash": "other"}])
            turn = turn_value(episode.id, 0)
            await store.add_turn(turn)
            with pytest.raises(Exception, match="already holds"):
                await store.add_turn(replace(turn, seq=1))
            await store.add_turn(turn_value(episode.id, 1))  # the writer goes on

    run(body())


def test_a_key_taken_first_in_a_batch_fails_that_write_alone(database_url: str) -> None:
    """Writes queued together are one transaction; one of them finding its key taken (on Postgres, inside its own
    savepoint) fails alone, and the others are recorded."""

    async def body() -> None:
        async with opened(lambda: SqlStore(database_url)) as store:
            episode = episode_value()
            await store.add_episode(episode)
            taken = turn_value(episode.id, 0)
            await store.add_turn(taken)
            outcomes = await asyncio.gather(
                store.add_turn(turn_value(episode.id, 1)),
                store.add_turn(replace(taken, seq=2)),
                store.add_turn(turn_value(episode.id, 3)),
                return_exceptions=True,
            )
            assert outcomes[0] is None and outcomes[2] is None, outcomes
            assert "already holds" in str(outcomes[1]), outcomes
            assert [turn.seq for turn in await store.turns(episode.id)] == [0, 1, 3]

    run(body())


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)  # a SQLite file has no connection to drop
def test_a_connection_the_database_dropped_between_writes_fails_no_write(database_url: str) -> None:

    async def body() -> None:
        async with opened(lambda: SqlStore(database_url)) as store:
            episode = episode_value()
            await store.add_episode(episode)
            assert store._engine is not None
            held = store._writer._conn if store._writer is not None else None
            assert held is not None, "the writer holds its connection from batch to batch"
            backend = held.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
            with store._engine.connect() as conn:  # the database drops the writer's connection (a restart would)
                conn.exec_driver_sql(f"SELECT pg_terminate_backend({int(backend)}, 5000)")  # (waits for it)
            await store.add_turn(turn_value(episode.id, 0))
            assert [turn.seq for turn in await store.turns(episode.id)] == [0]

    run(body())
