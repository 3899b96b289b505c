"""Group commit when another replica took a key first (shared mode, Postgres): an agent whose calls land on two
replicas makes one of them write a turn whose seq the other recorded already. That write fails alone, as stale,
and the writes batched with it still share one commit, instead of one commit each (which made three replicas
serve half the turns of two: benchmarks/RESULTS.md, section 15)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
import sqlalchemy
from sqlalchemy import Engine, event, text

from proxy.core.errors import Stale
from proxy.storage.engines import engine_url
from proxy.storage.writer import Writer
from testkit.databases import fresh_schema
from tests.conftest import POSTGRES_URL

pytestmark = pytest.mark.skipif(
    not POSTGRES_URL and not os.environ.get("CI"),
    reason="no Postgres server: set TRAJPROXY_TEST_POSTGRES_URL (bash .ci/run starts one and sets it)",
)

WAIT_S = 10
INSERT = text("INSERT INTO seqs (episode, seq) VALUES (:episode, :seq)")


@pytest.fixture
def engine() -> Iterator[Engine]:
    if not POSTGRES_URL:
        pytest.fail("CI must run the Postgres tests: .ci/run sets TRAJPROXY_TEST_POSTGRES_URL")
    with fresh_schema(POSTGRES_URL) as url:
        engine = sqlalchemy.create_engine(engine_url(url))
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE seqs (episode int, seq int, PRIMARY KEY (episode, seq))"))
        try:
            yield engine
        finally:
            engine.dispose()


def test_a_stale_write_fails_alone_and_the_rest_of_its_batch_shares_one_commit(engine: Engine) -> None:
    with engine.begin() as conn:  # seq 1 of episode 0, recorded by another replica
        conn.execute(INSERT, {"episode": 0, "seq": 1})
    commits: list[None] = []
    event.listen(engine, "commit", lambda _conn: commits.append(None))

    async def body() -> list[BaseException | None]:
        writer = Writer(engine)
        try:
            # The writer is busy with this one while the next ones queue: they are taken as one batch.
            busy = writer.write((text("SELECT pg_sleep(1)"), [{}]))
            batch = [writer.write((INSERT, [{"episode": episode, "seq": 1}])) for episode in range(5)]
            done = await asyncio.wait_for(asyncio.gather(busy, *batch, return_exceptions=True), WAIT_S)
            return list(done)[1:]
        finally:
            await writer.stop()

    outcomes = asyncio.run(body())
    assert isinstance(outcomes[0], Stale)
    assert outcomes[1:] == [None] * 4
    assert len(commits) <= 2  # the busy write's and the batch's (one per write: 5 or more)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM seqs")).scalar_one() == 5
