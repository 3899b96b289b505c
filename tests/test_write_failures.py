"""A database that refuses a write: what the broker holds about an episode (its next seq, its branches, its
status) follows only what the store accepted, so the calls after a failed write carry on as if it never was."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest

from proxy.adapters.litellm_upstream import LitellmUpstream
from proxy.adapters.tiktoken_counter import TiktokenCounter
from proxy.core.answers import LocalQueue
from proxy.core.broker import Broker
from proxy.core.context import Context
from proxy.core.errors import EpisodeClosed, StorageError
from proxy.core.open_turns import OpenTurn
from proxy.core.values import Episode, EpisodeStatus, Reply, Turn, Usage
from proxy.storage.sql import SqlStore

WAIT_S = 10.0
REFUSAL_S = 0.05  # a refused write fails after a moment, as a commit that fails does, not at once
SYSTEM = {"role": "system", "content": "you are an agent"}


class RefusingStore(SqlStore):
    """SqlStore whose next write of a kind named in `refuse` fails: a fault injector standing in for the database
    refusing it (the only fake here; everything else is the real broker on a real database)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.refuse: set[str] = set()

    def add_turn(self, turn: Turn) -> Awaitable[None]:
        return self._refused("add_turn") or super().add_turn(turn)

    def save_episode(self, episode: Episode) -> Awaitable[None]:
        return self._refused("save_episode") or super().save_episode(episode)

    def _refused(self, write: str) -> Awaitable[None] | None:
        if write not in self.refuse:
            return None
        self.refuse.discard(write)
        refused = asyncio.get_running_loop().create_future()
        error = StorageError(f"the database could not record this change ({write} refused by the test)")
        asyncio.get_running_loop().call_later(REFUSAL_S, refused.set_exception, error)
        return refused


@asynccontextmanager
async def broker_on(database_url: str) -> AsyncIterator[tuple[Broker, RefusingStore]]:
    store = RefusingStore(database_url)
    await store.open()
    context = Context.build(
        store=store, tokens=TiktokenCounter(), upstream=LitellmUpstream(), turn_timeout_s=WAIT_S, lease_s=WAIT_S
    )
    broker = Broker(context=context, queue=LocalQueue(context=context))
    try:
        yield broker, store
    finally:
        await broker.drain()
        await store.close()


def run(body: Coroutine[Any, Any, None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(WAIT_S * 3):
            await body

    asyncio.run(bounded())


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


async def call(broker: Broker, episode: Episode, messages: list[dict[str, Any]], *, retry: bool = False) -> OpenTurn:
    """An agent's chat call, as the agent routes hand it to the broker."""
    request = {"model": "policy", "messages": messages}
    return await broker.park(episode.id, "chat", request, json.dumps(request).encode(), stream=False, retry=retry)


async def answer(broker: Broker, open_turn: OpenTurn, text: str) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    await broker.answers.reply(open_turn.turn.id, Reply(message=message, finish_reason="stop", usage=Usage(10, 2)))
    return message


async def statuses(broker: Broker, store: RefusingStore, episode: Episode) -> tuple[EpisodeStatus, EpisodeStatus]:
    """The episode's status as the broker holds it, and as the database has it."""
    recorded = await store.episode(episode.id)
    assert recorded is not None
    return (await broker.episode(episode.id)).status, recorded.status


def test_a_call_whose_turn_was_refused_leaves_no_gap_in_seqs_and_no_branch_behind(database_url: str) -> None:
    async def body() -> None:
        async with broker_on(database_url) as (broker, store):
            episode, _ = await broker.create_episode("fix the bug", {})
            history = [SYSTEM, user("fix the bug")]
            first = await call(broker, episode, history)
            history += [await answer(broker, first, "looking"), user("next")]

            store.refuse.add("add_turn")
            with pytest.raises(StorageError):
                await call(broker, episode, history)
            # Its agent's SDK sends the call again: it continues the conversation right after the first turn.
            again = await call(broker, episode, history, retry=True)
            await answer(broker, again, "done")

            turns = await store.turns(episode.id)
            assert [(t.seq, t.branch, t.parent_id) for t in turns] == [(0, 0, None), (1, 0, first.turn.id)]
            assert turns[1].id == again.turn.id

    run(body())


def test_calls_at_once_whose_first_write_is_refused_take_contiguous_seqs(database_url: str) -> None:
    async def body() -> None:
        async with broker_on(database_url) as (broker, store):
            episode, _ = await broker.create_episode("three sub-agents at once", {})
            await answer(broker, await call(broker, episode, [user("plan")]), "three searches")

            store.refuse.add("add_turn")  # the first of the three calls' writes
            calls = [call(broker, episode, [user(f"search {n}")]) for n in range(3)]
            refused, *parked = await asyncio.gather(*calls, return_exceptions=True)
            assert isinstance(refused, StorageError)
            assert all(isinstance(open_turn, OpenTurn) for open_turn in parked)
            later = await call(broker, episode, [user("summarise")])

            turns = await store.turns(episode.id)
            assert [t.seq for t in turns] == [0, 1, 2, 3]
            assert [t.request["messages"][-1]["content"] for t in turns] == [
                "plan",
                "search 1",
                "search 2",
                "summarise",
            ]
            assert turns[-1].id == later.turn.id

    run(body())


def test_an_episode_whose_start_was_refused_is_pending_in_memory_as_in_the_database(database_url: str) -> None:
    async def body() -> None:
        async with broker_on(database_url) as (broker, store):
            episode, _ = await broker.create_episode("fix the bug", {})
            store.refuse.add("save_episode")  # the record of its start
            first = await call(broker, episode, [user("fix the bug")])  # the call itself is recorded and parked
            assert first.turn.seq == 0
            assert await statuses(broker, store, episode) == (EpisodeStatus.PENDING, EpisodeStatus.PENDING)

            await call(broker, episode, [user("a second call")])  # the next call records the start
            assert await statuses(broker, store, episode) == (EpisodeStatus.RUNNING, EpisodeStatus.RUNNING)

    run(body())


def test_an_episode_whose_finish_was_refused_stays_open_and_can_be_finished_again(database_url: str) -> None:
    async def body() -> None:
        async with broker_on(database_url) as (broker, store):
            episode, _ = await broker.create_episode("fix the bug", {})
            waiting = await call(broker, episode, [user("fix the bug")])

            store.refuse.add("save_episode")
            with pytest.raises(StorageError):
                await broker.finish(episode.id, EpisodeStatus.FINISHED, "tests pass")
            assert await statuses(broker, store, episode) == (EpisodeStatus.RUNNING, EpisodeStatus.RUNNING)
            assert not waiting.answer.done()  # its agent still waits for a reply, which can still come
            await answer(broker, waiting, "patched")
            assert (await asyncio.wait_for(waiting.answer, WAIT_S)).reply is not None
            second = await call(broker, episode, [user("fix the bug"), user("run the tests")])

            finished = await broker.finish(episode.id, EpisodeStatus.FINISHED, "tests pass")
            assert finished.status is EpisodeStatus.FINISHED
            assert await statuses(broker, store, episode) == (EpisodeStatus.FINISHED, EpisodeStatus.FINISHED)
            with pytest.raises(EpisodeClosed):
                await asyncio.wait_for(second.answer, WAIT_S)
            with pytest.raises(EpisodeClosed):
                await call(broker, episode, [user("one more")])

    run(body())
