"""The queue's contract: every `TurnQueue` (this process's open turns over SQLite or Postgres, and the database replicas
share) behaves the same to an agent and a trainer, driven in-process through the broker that owns it: a parked
call is pulled under a lease, answered once, the agent hears the reply, the same reply again succeeds, a different
one is refused, a reply under a lease that ran out is refused, a released turn comes back, a waiting pull wakes; a
closed episode's open turns fail, a turn whose agent hung up is out of the queue until its SDK's retry, a pause
holds new calls until its resume, whose policy version the reply carries. The shared queue is also the `Others` the
broker tells of those; each queue has the members of its interfaces and no others."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest

from proxy.adapters.litellm_upstream import LitellmUpstream
from proxy.adapters.tiktoken_counter import TiktokenCounter
from proxy.core.answers import LocalQueue
from proxy.core.broker import Broker
from proxy.core.context import Context
from proxy.core.errors import Conflict, EpisodeClosed, NotFound, TurnClosed
from proxy.core.open_turns import OpenTurn
from proxy.core.queue import Others, TurnQueue
from proxy.core.shared_queue import SharedQueue
from proxy.core.values import EpisodeStatus, Reply, TurnStatus, new_id
from proxy.storage.postgres_queue import PostgresQueue
from proxy.storage.sql import SqlStore
from tests.conftest import fresh_database

WAIT_S = 10.0
REQUEST = {"model": "policy", "messages": [{"role": "user", "content": "hello"}]}
ANSWER = Reply(message={"role": "assistant", "content": "hi"}, finish_reason="stop")


@pytest.fixture(params=["local-sqlite", "local-postgres", "shared-postgres"])
def kind(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[tuple[str, str]]:
    """Which queue, over which database: a fresh SQLite file or a schema of its own on the test Postgres."""
    queue, _, database = request.param.partition("-")
    with fresh_database(database, tmp_path) as url:
        yield queue, url


@asynccontextmanager
async def broker_over(kind: tuple[str, str]) -> AsyncIterator[Broker]:
    """A broker on the queue of this kind, as `create_app` builds it, started and stopped."""
    queue_kind, url = kind
    store = SqlStore(url, replica=new_id("rp") if queue_kind == "shared" else None)
    await store.open()
    context = Context.build(
        store=store, tokens=TiktokenCounter(), upstream=LitellmUpstream(), lease_s=WAIT_S, turn_timeout_s=WAIT_S
    )
    if queue_kind == "shared":
        shared = SharedQueue(context=context, database=PostgresQueue(store, dead_after_s=WAIT_S))
        queue: TurnQueue = shared
        others: Others | None = shared
    else:
        queue, others = LocalQueue(context=context), None
    broker = Broker(context=context, queue=queue, others=others)
    await broker.start()
    try:
        yield broker
    finally:
        await broker.drain()
        await broker.stop()
        await store.close()


def run(kind: tuple[str, str], body: Callable[[Broker], Coroutine[Any, Any, None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(WAIT_S * 3), broker_over(kind) as broker:
            await body(broker)

    asyncio.run(bounded())


async def call(broker: Broker, episode_id: str, content: str = "hello") -> asyncio.Future[Any]:
    """An agent's call, parked; returns what its agent waits on."""
    return (await park(broker, episode_id, content)).answer


async def park(broker: Broker, episode_id: str, content: str = "hello", *, retry: bool = False) -> OpenTurn:
    """An agent's call (or, `retry`, its SDK's retry of it), parked."""
    request = {**REQUEST, "messages": [{"role": "user", "content": content}]}
    return await broker.park(episode_id, "chat", request, orjson.dumps(request), stream=False, retry=retry)


def members(cls: type) -> set[str]:
    """A class's public members, its own and its protocols' (what a caller can reach)."""
    return {name for name in dir(cls) if not name.startswith("_")} | set(getattr(cls, "__annotations__", {}))


def test_each_queue_has_the_members_of_its_interfaces_and_no_others() -> None:
    """What a queue must do is `TurnQueue`; what only replicas sharing the database must hear is `Others`, which
    only the shared queue is: no queue implements a member it has nothing to do for."""
    assert members(LocalQueue) == members(TurnQueue)
    assert members(SharedQueue) == members(TurnQueue) | members(Others)


def test_a_parked_call_is_pulled_answered_once_and_heard(kind: tuple[str, str]) -> None:
    async def body(broker: Broker) -> None:
        episode, _ = await broker.create_episode("task", {})
        answer = await call(broker, episode.id)
        (pulled,) = await broker.queue.pull(None, 8, WAIT_S, None)
        assert (pulled.episode_id, pulled.status, pulled.deliveries) == (episode.id, TurnStatus.LEASED, 1)
        assert (await broker.queue.turn(pulled.id)).status is TurnStatus.LEASED
        answered = await broker.answers.reply(pulled.id, ANSWER, pulled.lease_id)
        heard = await asyncio.wait_for(answer, WAIT_S)
        assert heard.id == answered.id == pulled.id
        assert heard.reply is not None and heard.reply.message == ANSWER.message
        again = await broker.answers.reply(pulled.id, ANSWER, pulled.lease_id)  # a trainer's retry
        assert again.status is TurnStatus.ANSWERED
        other = Reply(message={"role": "assistant", "content": "something else"}, finish_reason="stop")
        with pytest.raises(Conflict, match="different reply"):
            await broker.answers.reply(pulled.id, other, pulled.lease_id)
        with pytest.raises(NotFound):
            await broker.answers.reply("tu_nosuchturn", ANSWER)
        _, turns, _ = await broker.trajectory(episode.id)
        assert [(turn.id, turn.status) for turn in turns] == [(pulled.id, TurnStatus.ANSWERED)]

    run(kind, body)


def test_a_reply_under_a_lease_that_ran_out_is_refused(kind: tuple[str, str]) -> None:
    async def body(broker: Broker) -> None:
        episode, _ = await broker.create_episode("task", {})
        answer = await call(broker, episode.id)
        (first,) = await broker.queue.pull(None, 1, WAIT_S, 0.2)
        (second,) = await broker.queue.pull(None, 1, WAIT_S, None)  # handed out again once the lease ran out
        assert second.id == first.id and second.deliveries == first.deliveries + 1
        outcomes = await broker.answers.reply_all(
            [(first.id, ANSWER, first.lease_id), (second.id, ANSWER, second.lease_id)]
        )
        assert isinstance(outcomes[0], Conflict) and "expired" in outcomes[0].message
        assert not isinstance(outcomes[1], Exception) and outcomes[1].status is TurnStatus.ANSWERED
        assert (await asyncio.wait_for(answer, WAIT_S)).status is TurnStatus.ANSWERED

    run(kind, body)


def test_a_released_turn_comes_back_and_a_waiting_pull_wakes(kind: tuple[str, str]) -> None:
    async def body(broker: Broker) -> None:
        episode, _ = await broker.create_episode("task", {})
        waiting = asyncio.ensure_future(broker.queue.pull(episode.id, 4, WAIT_S, None))
        await asyncio.sleep(0.2)
        assert not waiting.done() and broker.queue.waiting == 1
        await call(broker, episode.id)
        (pulled,) = await asyncio.wait_for(waiting, WAIT_S)  # woken by the call, not by its timeout
        broker.queue.release([pulled])
        (again,) = await broker.queue.pull(episode.id, 4, WAIT_S, None)
        assert again.id == pulled.id and again.lease_id != pulled.lease_id
        assert await broker.queue.pull(episode.id, 4, 0.1, None) == []  # nothing else is parked

    run(kind, body)


def test_a_closed_episodes_open_turns_fail_and_their_agents_hear_it(kind: tuple[str, str]) -> None:
    async def body(broker: Broker) -> None:
        episode, _ = await broker.create_episode("task", {})
        answer = await call(broker, episode.id)
        (pulled,) = await broker.queue.pull(episode.id, 1, WAIT_S, None)
        await broker.finish(episode.id, EpisodeStatus.CANCELLED, "enough")
        with pytest.raises(EpisodeClosed):
            await asyncio.wait_for(answer, WAIT_S)
        await broker.drain()
        assert (await broker.queue.turn(pulled.id)).status is TurnStatus.FAILED
        assert await broker.queue.pull(None, 4, 0.1, None) == []
        with pytest.raises(TurnClosed, match="cancelled"):
            await broker.answers.reply(pulled.id, ANSWER, pulled.lease_id)

    run(kind, body)


def test_a_turn_whose_agent_hung_up_waits_out_of_the_queue_for_its_retry(kind: tuple[str, str]) -> None:
    async def body(broker: Broker) -> None:
        episode, _ = await broker.create_episode("task", {})
        open_turn = await park(broker, episode.id)
        with broker.attend(open_turn, episode):  # the agent's exchange, ended before any reply: it hung up
            pass
        await broker.drain()
        assert await broker.queue.pull(None, 4, 0.2, None) == []  # withdrawn, wherever a trainer pulls
        retried = await park(broker, episode.id, retry=True)  # its SDK's retry: the same body
        assert retried.turn.id == open_turn.turn.id
        (pulled,) = await broker.queue.pull(None, 4, WAIT_S, None)
        assert pulled.id == open_turn.turn.id
        await broker.answers.reply(pulled.id, ANSWER, pulled.lease_id)
        assert (await asyncio.wait_for(retried.answer, WAIT_S)).status is TurnStatus.ANSWERED

    run(kind, body)


def test_a_pause_holds_new_calls_until_its_resume_whose_version_the_reply_carries(kind: tuple[str, str]) -> None:
    async def body(broker: Broker) -> None:
        episode, _ = await broker.create_episode("task", {})
        assert await broker.weights.pause("hold", 1.0) == 0
        answer = await call(broker, episode.id)
        await broker.drain()
        assert await broker.queue.pull(None, 4, 0.2, None) == []  # held, wherever a trainer pulls
        assert broker.weights.resume("v2") == 1
        (pulled,) = await broker.queue.pull(None, 4, WAIT_S, None)
        await broker.answers.reply(pulled.id, ANSWER, pulled.lease_id)
        heard = await asyncio.wait_for(answer, WAIT_S)
        assert heard.reply is not None and heard.reply.policy_version == "v2"
        assert broker.weights.policy_version == "v2"

    run(kind, body)
