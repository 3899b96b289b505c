"""Replies' token ids stored once (`proxy.storage.token_ids`): each turn's prompt written as the ids it shares with
its parent's prompt and sampled ids, and its own; every turn's ids read back exactly, alone or by episode, from a
database this code wrote and from one the previous commit's code wrote (upgraded in place)."""

from __future__ import annotations

import asyncio
import os
import pickle
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy

from proxy.core.prefixes import extension_of
from proxy.core.values import Reply, Turn, TurnStatus, Usage, new_id
from proxy.storage.engines import engine_url
from proxy.storage.sql import SqlStore
from proxy.storage.token_ids import unpack
from tests.test_storage_upgrade import previous_package

PREVIOUS = "750eadf"  # the last commit whose replies hold their ids in their JSON, the server's echo in `served`

# A chain of turns (some forked from an earlier turn, some drifting), recorded as trajproxy records them: each reply's
# `extends_parent` and `drift_at` as `proxy.core.answers` sets them. Run by this code and by the previous commit's.
RECORD = """
import asyncio, pickle, random, sys
from dataclasses import replace
from proxy.core.values import hash_key, new_id, new_key
from proxy.core.values import Episode, EpisodeStatus, Reply, Turn, TurnStatus, Usage
from proxy.storage.sql import SqlStore

def first_difference(earlier, prompt):
    for i, (a, b) in enumerate(zip(earlier, prompt)):
        if a != b:
            return i
    return None if len(prompt) >= len(earlier) else len(prompt)

async def record(store, turns, seed, big):
    rng = random.Random(seed)
    episode = Episode(new_id("ep"), hash_key(new_key()), "t", {}, EpisodeStatus.RUNNING, 1.0)
    await store.add_episode(episode)
    made = []
    for seq in range(turns):
        parent = made[-1] if made and seq % 9 else made[rng.randrange(len(made))] if made else None
        if parent is None:
            prompt = tuple(rng.randrange(big) for _ in range(50))
        else:
            earlier = parent.reply.prompt_token_ids + parent.reply.completion_token_ids
            cut = len(earlier) - rng.randrange(5) if seq % 7 == 3 else len(earlier)  # a drift now and then
            prompt = earlier[:cut] + tuple(rng.randrange(big) for _ in range(rng.randrange(1, 40)))
        sampled = tuple(rng.randrange(big) for _ in range(rng.randrange(0, 20)))
        turn = Turn(new_id("tu"), episode.id, seq, "chat", {"messages": []}, b"{}", False, TurnStatus.PARKED,
                    2.0 + seq, parent_id=parent.id if parent else None)
        await store.add_turn(turn)
        reply = Reply({"role": "assistant", "content": "x"}, "stop", Usage(len(prompt), len(sampled)),
                      prompt_token_ids=prompt, completion_token_ids=sampled,
                      logprobs=tuple(-0.25 for _ in sampled),
                      served={"response": {"choices": [{"prompt_token_ids": list(prompt)}]}})
        if parent is not None:
            drift = first_difference(parent.reply.prompt_token_ids + parent.reply.completion_token_ids, prompt)
            reply = replace(reply, extends_parent=drift is None, drift_at=drift)
        answered = replace(turn, status=TurnStatus.ANSWERED, reply=reply, answered_at=3.0)
        await store.save_turns([answered])
        made.append(answered)
    return episode.id, made

async def main(url, out_file, turns, seed, big):
    store = SqlStore(url)
    await store.open()
    episode_id, made = await record(store, int(turns), int(seed), int(big))
    read = await store.turns(episode_id)
    await store.close()
    open(out_file, "wb").write(pickle.dumps((episode_id, made, read)))

if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
"""


def recorded(url: str, tmp_path: Path, turns: int, seed: int, big: int, code: Path | None) -> tuple[str, list[Turn]]:
    """An episode of chained turns recorded by `code`'s `proxy` package (None: this one); the turns as made, after
    checking that the code read them back as made."""
    (tmp_path / "record.py").write_text(RECORD)
    env = {**os.environ, "PYTHONPATH": str(code) if code else str(Path(__file__).resolve().parent.parent)}
    out = tmp_path / f"out-{seed}"
    args = [sys.executable, str(tmp_path / "record.py"), url, str(out), str(turns), str(seed), str(big)]
    subprocess.run(args, check=True, env=env, cwd=tmp_path, timeout=300)
    episode_id, made, read = pickle.loads(out.read_bytes())
    assert [turn.reply for turn in read] == [turn.reply for turn in made]
    return episode_id, made


async def read_back(url: str, episode_id: str, made: list[Turn]) -> None:
    store = SqlStore(url)
    await store.open()
    try:
        read = await store.turns(episode_id)
        for turn, back in zip(made, read, strict=True):
            assert back.reply is not None and turn.reply is not None
            assert back.reply.prompt_token_ids == turn.reply.prompt_token_ids, turn.seq
            assert back.reply.completion_token_ids == turn.reply.completion_token_ids, turn.seq
            assert back.reply.logprobs == turn.reply.logprobs
        for turn in made[::5]:  # a turn alone reads its chain of parents
            alone = await store.turn(turn.id)
            assert alone is not None and alone.reply == read[turn.seq].reply
    finally:
        await store.close()


def stored_ids(url: str, episode_id: str) -> tuple[int, list[bytes | None]]:
    """The bytes the episode's replies' ids take in the database, and each turn's `token_ids` column."""
    engine = sqlalchemy.create_engine(engine_url(url))
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sqlalchemy.text("SELECT token_ids FROM turn WHERE episode_id = :e ORDER BY seq"), {"e": episode_id}
            ).all()
    finally:
        engine.dispose()
    columns = [bytes(row.token_ids) if row.token_ids is not None else None for row in rows]
    return sum(len(column) for column in columns if column is not None), columns


@pytest.mark.timeout(300)
def test_each_turn_s_ids_are_stored_once_and_read_back_exactly(database_url: str, tmp_path: Path) -> None:
    episode_id, made = recorded(database_url, tmp_path, 60, seed=3, big=200_000, code=None)
    asyncio.run(read_back(database_url, episode_id, made))
    size, columns = stored_ids(database_url, episode_id)
    assert all(column is not None for column in columns)
    # each id once: the turns' own ids (new prompt ids and sampled ids), 4 bytes each, and a 12-byte header
    own = 0
    for turn in made:
        assert turn.reply is not None and turn.reply.prompt_token_ids is not None
        parent = next((p for p in made if p.id == turn.parent_id), None)
        shared = 0
        if parent is not None and parent.reply is not None:
            earlier = parent.reply.prompt_token_ids or ()
            drift = extension_of(earlier, parent.reply.completion_token_ids or (), turn.reply.prompt_token_ids)
            shared = len(earlier) + len(parent.reply.completion_token_ids or ()) if drift is None else drift
        own += len(turn.reply.prompt_token_ids) - shared + len(turn.reply.completion_token_ids or ())
    assert size == 4 * own + 12 * len(made)
    assert sum(unpack(column)[0] > 0 for column in columns if column is not None) == len(made) - 1  # all but the first


@pytest.mark.timeout(600)
def test_a_database_the_previous_code_wrote_reads_back_and_goes_on(database_url: str, tmp_path: Path) -> None:
    old = previous_package(tmp_path / "previous", PREVIOUS)
    episode_id, made = recorded(database_url, tmp_path, 30, seed=5, big=50_000, code=old)
    asyncio.run(read_back(database_url, episode_id, made))  # this code opens it: the new column added, ids as they were

    async def go_on() -> list[Turn]:
        """Two more turns, continuing the previous code's last: the first written whole (its parent's ids are in
        the parent's JSON), the second against the first."""
        store = SqlStore(database_url)
        await store.open()
        try:
            more = []
            parent = made[-1]
            for seq in (len(made), len(made) + 1):
                assert parent.reply is not None and parent.reply.prompt_token_ids is not None
                prompt = parent.reply.prompt_token_ids + (parent.reply.completion_token_ids or ()) + (7, 8, 9)
                turn = Turn(new_id("tu"), episode_id, seq, "chat", {"messages": []}, b"{}", False, TurnStatus.PARKED,
                            9.0, parent_id=parent.id)  # fmt: skip
                await store.add_turn(turn)
                reply = Reply({"role": "assistant", "content": "y"}, "stop", Usage(len(prompt), 2),
                              prompt_token_ids=prompt, completion_token_ids=(5, 6), extends_parent=True)  # fmt: skip
                parent = replace(turn, status=TurnStatus.ANSWERED, reply=reply, answered_at=9.5)
                await store.save_turns([parent])
                more.append(parent)
            return more
        finally:
            await store.close()

    more = asyncio.run(go_on())
    asyncio.run(read_back(database_url, episode_id, [*made, *more]))
    _, columns = stored_ids(database_url, episode_id)
    assert columns[: len(made)] == [None] * len(made)  # the previous code's, in their JSON as they were
    first, second = columns[len(made) :]
    assert first is not None and unpack(first)[0] == 0  # its parent wrote no column: whole
    assert second is not None and unpack(second)[0] > 0 and len(second) == 12 + 4 * 5  # 7, 8, 9 and 5, 6
