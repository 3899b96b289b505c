"""The Store port's contract, run against SqlStore on SQLite and on Postgres."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

import pytest

from proxy.core.errors import StorageError
from proxy.core.ports import Store
from proxy.core.values import (
    AgentError,
    Episode,
    EpisodeStatus,
    Reply,
    Reward,
    Tally,
    Turn,
    TurnStatus,
    Usage,
    hash_key,
    new_id,
    new_key,
)
from proxy.storage.content import TURN_STATE, turn_state
from proxy.storage.sql import SqlStore

T0 = 1_700_000_000.123456
WAIT_S = 10  # bound on any one write: a writer that died would otherwise hang the test

METADATA = {
    "image": "python:3.12-slim",
    "tags": ["ß", "日本語", "🚀", "ünïcödé"],
    "nested": {"depth": {"n": 3, "x": 0.25, "ok": True, "missing": None, "big": 10**15}},
    "ключ": "значение",
    "empty": {},
    "rows": [{"a": 1}, {"b": [1.5, -2, "три"]}],
}

MakeStore = Callable[[], Store]
S = TypeVar("S", bound=Store)


def episode_value(**changes: Any) -> Episode:
    values: dict[str, Any] = {
        "id": new_id("ep"),
        "key_hash": hash_key(new_key()),
        "task": "fix the failing test",
        "metadata": {},
        "status": EpisodeStatus.PENDING,
        "created_at": T0,
    }
    return Episode(**{**values, **changes})


def turn_value(episode_id: str, seq: int, **changes: Any) -> Turn:
    request = {"model": "policy", "messages": [{"role": "user", "content": f"step {seq}: héllo 🌍"}]}
    values: dict[str, Any] = {
        "id": new_id("tu"),
        "episode_id": episode_id,
        "seq": seq,
        "dialect": "chat",
        "request": request,
        "wire": '{"messages":[{"content":"héllo 🌍"}]}'.encode(),
        "stream": False,
        "status": TurnStatus.PARKED,
        "created_at": T0 + seq,
    }
    return Turn(**{**values, **changes})


def full_reply() -> Reply:
    return Reply(
        message={
            "role": "assistant",
            "content": "voilà ✓",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}],
        },
        finish_reason="tool_calls",
        usage=Usage(prompt_tokens=123, completion_tokens=45),
        prompt_token_ids=(1, 2, 3, 100_000),
        completion_token_ids=(7, 8),
        logprobs=(-0.30000000000000004, -1.5e-07),
        policy_version="step-42",
        answered_by="model:openai/gpt-4o-mini",
    )


def run(body: Coroutine[Any, Any, None]) -> None:
    asyncio.run(body)


async def settled(write: Awaitable[None]) -> None:
    await asyncio.wait_for(write, WAIT_S)


@asynccontextmanager
async def opened(make_store: Callable[[], S]) -> AsyncIterator[S]:
    store = make_store()
    await store.open()
    try:
        yield store
    finally:
        await store.close()


class StoreContract:
    """What every Store must do; an implementation's test class provides the `make_store` fixture."""

    @pytest.fixture
    def make_store(self) -> MakeStore:
        raise NotImplementedError

    # Episodes

    def test_episode_round_trips_every_field(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                full = episode_value(
                    task="réparer le test 🛠",
                    metadata=METADATA,
                    status=EpisodeStatus.FAILED,
                    turn_timeout_s=12.5,
                    started_at=T0 + 1.25,
                    ended_at=T0 + 99.5,
                    reason="agent crashed: ошибка",
                )
                bare = episode_value()
                await settled(store.add_episode(full))
                await settled(store.add_episode(bare))
                assert await store.episode(full.id) == full
                assert await store.episode(bare.id) == bare
                assert await store.episode("ep_missing") is None

        run(body())

    def test_episode_by_key_hash(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                one, two = episode_value(), episode_value()
                await asyncio.gather(settled(store.add_episode(one)), settled(store.add_episode(two)))
                assert await store.episode_by_key_hash(two.key_hash) == two
                assert await store.episode_by_key_hash(one.key_hash) == one
                assert await store.episode_by_key_hash(hash_key(new_key())) is None

        run(body())

    def test_save_episode_updates_it(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                episode = episode_value(metadata={"a": 1})
                other = episode_value()
                await settled(store.add_episode(episode))
                await settled(store.add_episode(other))
                done = replace(
                    episode, status=EpisodeStatus.FINISHED, started_at=T0 + 1, ended_at=T0 + 2, reason="tests pass"
                )
                await settled(store.save_episode(done))
                assert await store.episode(episode.id) == done
                assert await store.episode(other.id) == other

        run(body())

    def test_duplicate_episode_id_or_key_is_refused(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                episode = episode_value()
                await settled(store.add_episode(episode))
                with pytest.raises(StorageError):
                    await settled(store.add_episode(replace(episode, key_hash=hash_key(new_key()))))
                with pytest.raises(StorageError):
                    await settled(store.add_episode(episode_value(key_hash=episode.key_hash)))
                assert await store.episode(episode.id) == episode

        run(body())

    def test_episodes_newest_first_with_status_filter_limit_and_offset(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                statuses = [EpisodeStatus.PENDING, EpisodeStatus.RUNNING, EpisodeStatus.FINISHED] * 2
                made = [episode_value(created_at=T0 + i, status=s) for i, s in enumerate(statuses)]
                for episode in reversed(made):  # insertion order must not be what decides the order
                    await settled(store.add_episode(episode))
                newest_first = list(reversed(made))

                assert await store.episodes(None, 100, 0) == newest_first
                assert await store.episodes(None, 2, 1) == newest_first[1:3]
                assert await store.episodes(None, 100, 6) == []
                running = await store.episodes(EpisodeStatus.RUNNING, 100, 0)
                assert running == [made[4], made[1]]
                assert await store.episodes(EpisodeStatus.FINISHED, 1, 1) == [made[2]]
                assert await store.episodes(EpisodeStatus.CANCELLED, 100, 0) == []

        run(body())

    def test_paging_through_episodes_created_at_the_same_instant_sees_each_once(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                made = [episode_value(created_at=T0) for _ in range(7)]
                for episode in made:
                    await settled(store.add_episode(episode))
                seen = [e.id for offset in range(0, 8, 2) for e in await store.episodes(None, 2, offset)]
                assert sorted(seen) == sorted(e.id for e in made)

        run(body())

    # Turns

    def test_turn_round_trips_every_field(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                episode = episode_value()
                await settled(store.add_episode(episode))
                parked = turn_value(episode.id, 0)
                answered = turn_value(
                    episode.id,
                    1,
                    dialect="anthropic",
                    request={"model": "claude", "messages": [{"role": "user", "content": "日本語 ✓"}], "x": [None]},
                    wire=b'{"content": "\xc3\xa9\xf0\x9f\x8c\x8d"}\x00\xff\xfe',
                    stream=True,
                    status=TurnStatus.ANSWERED,
                    model="claude",
                    deliveries=2,
                    leased_at=T0 + 1.5,
                    answered_at=T0 + 2.75,
                    ended_at=T0 + 3.125,
                    reply=full_reply(),
                    reason="answered by trainer",
                )
                failed = turn_value(
                    episode.id,
                    2,
                    status=TurnStatus.FAILED,
                    ended_at=T0 + 4,
                    reply=Reply(error=AgentError(429, "slow down: медленнее", "rate_limit_error")),
                    reason="trainer gave an error",
                )
                for turn in (failed, parked, answered):
                    await settled(store.add_turn(turn))

                assert await store.turn(parked.id) == parked
                assert await store.turn(answered.id) == answered
                assert await store.turn(failed.id) == failed
                assert await store.turns(episode.id) == [parked, answered, failed]
                assert await store.turn("tu_missing") is None
                assert await store.turns("ep_missing") == []

        run(body())

    def test_turn_with_nul_characters_round_trips(self, make_store: MakeStore) -> None:
        # A tool's output (`cat` of a binary file) can carry U+0000; the agent's call must still be recorded.
        async def body() -> None:
            async with opened(make_store) as store:
                episode = episode_value()
                await settled(store.add_episode(episode))
                output = "ELF\u0000\u0001\u0000 binary"
                turn = turn_value(
                    episode.id,
                    0,
                    request={"messages": [{"role": "tool", "tool_call_id": "call_1", "content": output}]},
                    wire=b'{"content":"ELF\\u0000"}',
                )
                await settled(store.add_turn(turn))
                answered = replace(
                    turn, status=TurnStatus.ANSWERED, reply=Reply(message={"role": "assistant", "content": "a\u0000b"})
                )
                await settled(store.save_turns([answered]))
                assert await store.turn(turn.id) == answered

        run(body())

    def test_save_turns_updates_state_and_keeps_the_request(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                episode = episode_value()
                await settled(store.add_episode(episode))
                first, second, untouched = (turn_value(episode.id, seq) for seq in range(3))
                for turn in (first, second, untouched):
                    await settled(store.add_turn(turn))

                answered = replace(
                    first,
                    status=TurnStatus.ANSWERED,
                    deliveries=1,
                    leased_at=T0 + 10,
                    answered_at=T0 + 11,
                    ended_at=T0 + 11.5,
                    reply=full_reply(),
                )
                leased = replace(second, status=TurnStatus.LEASED, deliveries=3, leased_at=T0 + 12)
                await settled(store.save_turns([answered, leased]))
                await settled(store.save_turns([]))

                assert await store.turns(episode.id) == [answered, leased, untouched]
                stored = await store.turn(first.id)
                assert stored is not None
                assert (stored.request, stored.wire, stored.stream) == (first.request, first.wire, first.stream)
                assert stored.reply is not None and stored.reply.usage == Usage(123, 45)

                expired = replace(leased, status=TurnStatus.EXPIRED, ended_at=T0 + 20, reason="no reply in 30 s")
                await settled(store.save_turns([expired]))
                assert await store.turn(second.id) == expired

        run(body())

    def test_tally_next_seq(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                episode, other = episode_value(), episode_value()
                await settled(store.add_episode(episode))
                await settled(store.add_episode(other))
                assert (await store.tally(episode.id)).next_seq == 0
                assert (await store.tally("ep_missing")).next_seq == 0
                for seq in (0, 1, 2):
                    await settled(store.add_turn(turn_value(episode.id, seq)))
                assert (await store.tally(episode.id)).next_seq == 3
                await settled(store.add_turn(turn_value(episode.id, 9)))
                assert (await store.tally(episode.id)).next_seq == 10
                assert (await store.tally(other.id)).next_seq == 0

        run(body())

    def test_the_saved_turn_columns_are_the_ones_that_change(self) -> None:
        assert tuple(turn_state(turn_value("ep_x", 0))) == TURN_STATE  # the UPDATE statement is built from these

    def test_tally_tokens_and_branches(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                episode = episode_value()
                await settled(store.add_episode(episode))
                assert await store.tally(episode.id) == Tally(0, 0, 0)
                first, second = turn_value(episode.id, 0), turn_value(episode.id, 1, branch=3, trainable=False)
                await settled(store.add_turn(first))
                await settled(store.add_turn(second))
                answered = replace(first, status=TurnStatus.ANSWERED, reply=full_reply())
                await settled(store.save_turns([answered]))
                assert await store.tally(episode.id) == Tally(next_seq=2, tokens=123 + 45, next_branch=4)
                assert [(t.branch, t.trainable) for t in await store.turns(episode.id)] == [(0, True), (3, False)]

        run(body())

    def test_open_turns_are_the_parked_and_leased_of_every_episode(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                one, two = episode_value(), episode_value()
                await settled(store.add_episode(one))
                await settled(store.add_episode(two))
                assert await store.open_turns() == []
                statuses = [TurnStatus.ANSWERED, TurnStatus.LEASED, TurnStatus.ABANDONED, TurnStatus.PARKED]
                for episode in (two, one):
                    for seq, status in enumerate(statuses):
                        await settled(store.add_turn(turn_value(episode.id, seq, status=status, deliveries=seq % 2)))
                left = await store.open_turns()
                assert [(t.episode_id, t.seq) for t in left] == sorted((e.id, s) for e in (one, two) for s in (1, 3))
                assert [t.status for t in left] == [TurnStatus.LEASED, TurnStatus.PARKED] * 2
                assert left[0] == await store.turn(left[0].id)

        run(body())

    def test_latest_answered_are_the_episodes_latest_answers_first(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                episode, other = episode_value(), episode_value()
                await settled(store.add_episode(episode))
                await settled(store.add_episode(other))
                assert await store.latest_answered(episode.id, 2) == []
                turns = [turn_value(episode.id, seq) for seq in range(4)]
                for turn in turns:
                    await settled(store.add_turn(turn))
                await settled(store.add_turn(turn_value(other.id, 0)))
                assert await store.latest_answered(episode.id, 2) == []  # parked turns are not answers
                # Answered out of order: the second call's answer is the latest.
                answered = [
                    replace(turns[seq], status=TurnStatus.ANSWERED, reply=full_reply(), answered_at=T0 + at)
                    for seq, at in ((0, 10), (2, 11), (1, 12))
                ]
                await settled(store.save_turns(answered))
                assert await store.latest_answered(episode.id, 2) == [answered[2], answered[1]]
                assert await store.latest_answered(episode.id, 16) == answered[::-1]
                assert await store.latest_answered(other.id, 16) == []

        run(body())

    def test_branch_heads_are_the_latest_turn_of_each_newest_branch(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                episode, other = episode_value(), episode_value()
                await settled(store.add_episode(episode))
                await settled(store.add_episode(other))
                assert await store.branch_heads(episode.id, 8) == []
                branches = [0, 0, 1, 0, 2, 1, 3]  # seq by seq; whatever became of a turn, it heads its branch
                statuses = [TurnStatus.ANSWERED] * 5 + [TurnStatus.ABANDONED, TurnStatus.PARKED]
                turns = [
                    turn_value(episode.id, seq, branch=branch, status=status)
                    for seq, (branch, status) in enumerate(zip(branches, statuses, strict=True))
                ]
                for turn in turns:
                    await settled(store.add_turn(turn))
                await settled(store.add_turn(turn_value(other.id, 0, branch=0)))
                heads = await store.branch_heads(episode.id, 8)
                assert heads == [turns[3], turns[5], turns[4], turns[6]]  # by branch, each its latest turn
                assert await store.branch_heads(episode.id, 2) == [turns[4], turns[6]]  # the newest branches
                assert [(t.episode_id, t.seq) for t in await store.branch_heads(other.id, 8)] == [(other.id, 0)]

        run(body())

    def test_turn_of_unknown_episode_is_refused(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                orphan = turn_value("ep_missing", 0)
                with pytest.raises(StorageError):
                    await settled(store.add_turn(orphan))
                assert await store.turn(orphan.id) is None

        run(body())

    # Rewards

    def test_rewards_round_trip_ordered_by_created_at(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                episode, other = episode_value(), episode_value()
                await settled(store.add_episode(episode))
                await settled(store.add_episode(other))
                turn = turn_value(episode.id, 0)
                await settled(store.add_turn(turn))
                late = Reward(
                    new_id("rw"), episode.id, "tests_passed", 1.0, "grader", T0 + 30, info={"passed": ["test_ü"]}
                )
                early = Reward(
                    new_id("rw"),
                    episode.id,
                    "style",
                    -0.25,
                    "trainer",
                    T0 + 10,
                    turn_id=turn.id,
                    info={"notes": "trop long — 太长", "scores": {"a": [0.5, None, True]}},
                )
                middle = Reward(new_id("rw"), episode.id, "reward", 0.125, "grader", T0 + 20)
                elsewhere = Reward(new_id("rw"), other.id, "reward", 5.0, "grader", T0)
                for reward in (late, early, elsewhere, middle):
                    await settled(store.add_reward(reward))

                assert await store.rewards(episode.id) == [early, middle, late]
                assert await store.rewards(other.id) == [elsewhere]
                assert await store.rewards("ep_missing") == []

        run(body())

    # Durability and group commit

    def test_a_write_is_visible_to_another_store_once_its_awaitable_completes(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as writer, opened(make_store) as reader:
                episode = episode_value(metadata=METADATA)
                await settled(writer.add_episode(episode))
                assert await reader.episode(episode.id) == episode

                turn = turn_value(episode.id, 0)
                await settled(writer.add_turn(turn))
                assert await reader.turns(episode.id) == [turn]

                answered = replace(turn, status=TurnStatus.ANSWERED, answered_at=T0 + 5, reply=full_reply())
                await settled(writer.save_turns([answered]))
                assert await reader.turn(turn.id) == answered

                reward = Reward(new_id("rw"), episode.id, "reward", 1.0, "grader", T0)
                await settled(writer.add_reward(reward))
                assert await reader.rewards(episode.id) == [reward]

                running = replace(episode, status=EpisodeStatus.RUNNING, started_at=T0 + 1)
                await settled(writer.save_episode(running))
                assert await reader.episode(episode.id) == running

        run(body())

    def test_writes_commit_in_the_order_they_were_submitted(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                episode = episode_value()
                turn = turn_value(episode.id, 0)
                answered = replace(turn, status=TurnStatus.ANSWERED, reply=full_reply(), answered_at=T0 + 1)
                # None awaited before the next is submitted: the turn needs its episode, the update its turn.
                writes = [
                    store.add_episode(episode),
                    store.add_turn(turn),
                    store.save_turns([answered]),
                    store.save_episode(replace(episode, status=EpisodeStatus.RUNNING)),
                ]
                await asyncio.gather(*(settled(write) for write in writes))
                assert await store.turns(episode.id) == [answered]
                stored = await store.episode(episode.id)
                assert stored is not None and stored.status is EpisodeStatus.RUNNING

        run(body())

    def test_many_concurrent_writes_all_land_and_a_bad_one_fails_alone(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                episodes = [episode_value() for _ in range(5)]
                for episode in episodes:
                    await settled(store.add_episode(episode))
                made = [turn_value(episodes[i % 5].id, i // 5) for i in range(500)]
                duplicate = turn_value(episodes[0].id, 7)  # seq 7 of episode 0 is made[35]
                writes = [store.add_turn(turn) for turn in made[:250]]
                writes.append(store.add_turn(duplicate))
                writes += [store.add_turn(turn) for turn in made[250:]]

                outcomes = await asyncio.gather(*(settled(write) for write in writes), return_exceptions=True)

                assert isinstance(outcomes[250], StorageError)
                failures = [outcome for i, outcome in enumerate(outcomes) if i != 250 and outcome is not None]
                assert failures == []
                assert await store.turn(duplicate.id) is None
                for episode in episodes:
                    expected = [turn for turn in made if turn.episode_id == episode.id]
                    assert await store.turns(episode.id) == expected
                    assert (await store.tally(episode.id)).next_seq == 100

        run(body())

    def test_the_store_keeps_working_after_a_failed_write(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                episode = episode_value()
                await settled(store.add_episode(episode))
                with pytest.raises(StorageError):
                    await settled(store.add_episode(episode))
                turn = turn_value(episode.id, 0)
                await settled(store.add_turn(turn))
                assert await store.turns(episode.id) == [turn]

        run(body())

    def test_a_write_that_cannot_be_encoded_fails_alone_and_the_writer_survives(self, make_store: MakeStore) -> None:
        async def body() -> None:
            async with opened(make_store) as store:
                episode = episode_value()
                await settled(store.add_episode(episode))
                unencodable = turn_value(episode.id, 0, request={"not json": object()})
                with pytest.raises(StorageError):
                    await settled(store.add_turn(unencodable))
                turn = turn_value(episode.id, 0)
                await settled(store.add_turn(turn))
                assert await store.turns(episode.id) == [turn]

        run(body())

    def test_data_survives_close_and_reopen(self, make_store: MakeStore) -> None:
        episode = episode_value(metadata=METADATA, status=EpisodeStatus.RUNNING, started_at=T0 + 1)
        turns = [turn_value(episode.id, seq, reply=full_reply() if seq % 2 else None) for seq in range(50)]
        reward = Reward(new_id("rw"), episode.id, "reward", 0.5, "grader", T0, turn_id=turns[0].id)

        async def write_and_close() -> None:
            store = make_store()
            await store.open()
            await settled(store.add_episode(episode))
            # Submitted but not awaited: closing must still commit them.
            pending = [store.add_turn(turn) for turn in turns] + [store.add_reward(reward)]
            await store.close()
            await asyncio.gather(*(settled(one) for one in pending))

        async def read() -> None:
            async with opened(make_store) as store:
                assert await store.episode(episode.id) == episode
                assert await store.episode_by_key_hash(episode.key_hash) == episode
                assert await store.turns(episode.id) == turns
                assert await store.rewards(episode.id) == [reward]
                assert (await store.tally(episode.id)).next_seq == 50

        run(write_and_close())
        run(read())


class TestSqlStore(StoreContract):
    @pytest.fixture
    def make_store(self, database_url: str) -> MakeStore:
        return lambda: SqlStore(database_url)
