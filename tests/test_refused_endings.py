"""A turn whose end the database refuses to record (a full disk, a lost connection): its agent still hears how the
turn ended, through every queue, whatever ended it: a model's failure, a fork's divergence, the turn timeout, the
episode's finish; and no agent is handed a reply the database does not hold. The database itself refuses: a trigger
made in it rejects every change to a recorded turn (new turns are still recorded), as a real fault would."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import pytest
import sqlalchemy

from proxy.core.broker import Broker
from proxy.core.errors import Conflict, EpisodeClosed, StorageError, TurnTimeout, UpstreamError
from proxy.core.values import Answerer, EpisodeStatus, Reply, TurnStatus
from proxy.storage.engines import engine_url
from tests.conftest import FakeModel, fresh_database
from tests.test_queue_contract import ANSWER, WAIT_S, broker_over, call

MODEL_WAIT_S = 40.0  # litellm's first call in a process can take seconds on a busy machine
REFUSE = {
    "sqlite": [
        "CREATE TRIGGER refuse_turn_changes BEFORE UPDATE ON turn BEGIN SELECT RAISE(ABORT, 'disk full'); END",
    ],
    "postgresql": [
        "CREATE FUNCTION refuse_turn_changes() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'disk full'; END $$",
        "CREATE TRIGGER refuse_turn_changes BEFORE UPDATE ON turn FOR EACH ROW EXECUTE FUNCTION refuse_turn_changes()",
    ],
}
ACCEPT = {
    "sqlite": ["DROP TRIGGER refuse_turn_changes"],
    "postgresql": ["DROP TRIGGER refuse_turn_changes ON turn", "DROP FUNCTION refuse_turn_changes()"],
}


@pytest.fixture(params=["local-sqlite", "local-postgres", "shared-postgres"])
def kind(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[tuple[str, str]]:
    """Which queue, over which database (as in test_queue_contract)."""
    queue, _, database = request.param.partition("-")
    with fresh_database(database, tmp_path) as url:
        yield queue, url


@contextmanager
def turn_changes_refused(url: str) -> Iterator[None]:
    """The database refuses every change to a recorded turn until the block ends."""
    engine = sqlalchemy.create_engine(engine_url(url))
    try:
        with engine.begin() as conn:
            for statement in REFUSE[engine.dialect.name]:
                conn.execute(sqlalchemy.text(statement))
        yield
        with engine.begin() as conn:
            for statement in ACCEPT[engine.dialect.name]:
                conn.execute(sqlalchemy.text(statement))
    finally:
        engine.dispose()


def run(kind: tuple[str, str], body: Any) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(MODEL_WAIT_S + WAIT_S), broker_over(kind) as broker:
            await body(broker)

    asyncio.run(bounded())


def test_a_model_failure_that_cannot_be_recorded_still_reaches_its_agent(
    kind: tuple[str, str], fake_model: FakeModel
) -> None:
    async def body(broker: Broker) -> None:
        # The upstream imports litellm on its first call, on the loop: seconds on a busy machine. Not on the clock here.
        await asyncio.to_thread(importlib.import_module, "litellm")
        policy = Answerer("openai/gpt-4o-mini", fake_model.options())
        episode, _ = await broker.create_episode("task", {}, policy=policy)
        with turn_changes_refused(kind[1]):
            answer = await call(broker, episode.id, "please fail")
            with pytest.raises(UpstreamError, match="the model is down"):
                await asyncio.wait_for(answer, MODEL_WAIT_S)

    run(kind, body)


def test_a_fork_divergence_that_cannot_be_recorded_still_reaches_its_agent(kind: tuple[str, str]) -> None:
    async def body(broker: Broker) -> None:
        parent, _ = await broker.create_episode("task", {})
        answer = await call(broker, parent.id, "hello")
        (pulled,) = await broker.queue.pull(parent.id, 1, WAIT_S, None)
        await broker.answers.reply(pulled.id, ANSWER, pulled.lease_id)
        await asyncio.wait_for(answer, WAIT_S)
        await broker.finish(parent.id, EpisodeStatus.FINISHED, None)
        [(fork, _)] = await broker.fork(parent.id, 1, 1, on_divergence="fail")
        with turn_changes_refused(kind[1]):
            answer = await call(broker, fork.id, "something else")
            with pytest.raises(Conflict, match="the replay stopped: call 0 differs"):
                await asyncio.wait_for(answer, WAIT_S)

    run(kind, body)


def test_a_turn_timeout_that_cannot_be_recorded_still_reaches_its_agent(kind: tuple[str, str]) -> None:
    async def body(broker: Broker) -> None:
        episode, _ = await broker.create_episode("task", {}, turn_timeout_s=0.2)
        with turn_changes_refused(kind[1]):
            request = {"model": "policy", "messages": [{"role": "user", "content": "hello"}]}
            open_turn = await broker.park(episode.id, "chat", request, orjson.dumps(request), stream=False)
            with broker.attend(open_turn, episode), pytest.raises(TurnTimeout):  # its exchange starts the turn timeout
                await asyncio.wait_for(open_turn.answer, WAIT_S)

    run(kind, body)


def test_a_finish_whose_turns_cannot_be_recorded_still_tells_their_agents(kind: tuple[str, str]) -> None:
    async def body(broker: Broker) -> None:
        episode, _ = await broker.create_episode("task", {})
        answers = [await call(broker, episode.id, f"call {n}") for n in range(3)]
        with turn_changes_refused(kind[1]):
            with pytest.raises(StorageError):  # the trainer hears the turns' ends were not recorded
                await broker.finish(episode.id, EpisodeStatus.CANCELLED, "stopped")
            for answer in answers:  # and the agents hear the episode has ended
                with pytest.raises(EpisodeClosed, match="stopped"):
                    await asyncio.wait_for(answer, WAIT_S)

    run(kind, body)


def test_no_agent_is_handed_a_reply_the_database_refused(kind: tuple[str, str]) -> None:
    async def body(broker: Broker) -> None:
        episode, _ = await broker.create_episode("task", {})
        answer = await call(broker, episode.id)
        (pulled,) = await broker.queue.pull(episode.id, 1, WAIT_S, None)
        with turn_changes_refused(kind[1]), pytest.raises(StorageError):
            await broker.answers.reply(pulled.id, ANSWER, pulled.lease_id)
        if kind[0] == "local":  # this process ended the turn: failed, and its agent hears why
            with pytest.raises(StorageError):
                await asyncio.wait_for(answer, WAIT_S)
            assert (await broker.queue.turn(pulled.id)).status is TurnStatus.FAILED
        else:  # the database still holds the turn open under its lease: the trainer's retry lands once it can
            assert not answer.done()
            again = Reply(message={"role": "assistant", "content": "again"}, finish_reason="stop")
            await broker.answers.reply(pulled.id, again, pulled.lease_id)
            heard = await asyncio.wait_for(answer, WAIT_S)
            assert heard.reply is not None and heard.reply.message == again.message

    run(kind, body)
