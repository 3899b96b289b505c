"""`Endings` keeps the turns settled lately at hand, bounded by their number and by what they hold: a coding agent's
call can be a megabyte, a fuzzer's 16 MiB, and 4,096 of them (or 64) held gigabytes. A turn whose write is still on
its way stays at hand whatever its size, so its latest state is never read stale from the store."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from contextlib import closing
from dataclasses import replace
from pathlib import Path

from proxy.core.endings import Endings, held_bytes
from proxy.core.errors import NotFound
from proxy.core.ids import TokenIds
from proxy.core.open_turns import OpenTurns
from proxy.core.values import Extension, Reply, TurnStatus
from proxy.storage.sql import SqlStore
from tests.test_store import episode_value, turn_value

MiB = 2**20
HELD_S = 30.0


async def kept(endings: Endings, turn_ids: list[str]) -> list[bool]:
    """Which of the turns `Endings` still has at hand (none was ever written, so the store knows none of them)."""
    found = []
    for turn_id in turn_ids:
        try:
            await endings.turn(turn_id)
            found.append(True)
        except NotFound:
            found.append(False)
    return found


def test_settled_turns_at_hand_are_bounded_by_number_and_by_what_they_hold(tmp_path: Path) -> None:
    async def body() -> None:
        store = SqlStore(f"sqlite:///{tmp_path}/endings.db")
        await store.open()
        try:
            endings = Endings(OpenTurns(lambda _open_turn: None), store, time.time)
            one_mib, sixteen_mib = b"x" * MiB, b"x" * 16 * MiB  # each turn's wire the same bytes: memory is shared
            big = [turn_value("ep_big", seq, wire=one_mib, status=TurnStatus.ANSWERED) for seq in range(100)]
            for turn in big:
                endings.remember(turn)
            # Each holds its call as received and as parsed, about 2 MiB: the newest 64 fit in 128 MiB
            assert held_bytes(big[0]) == 2 * MiB
            assert await kept(endings, [turn.id for turn in big]) == [False] * 36 + [True] * 64

            huge = [turn_value("ep_huge", seq, wire=sixteen_mib, status=TurnStatus.ANSWERED) for seq in range(70)]
            for turn in huge:
                endings.remember(turn)
            assert await kept(endings, [turn.id for turn in huge]) == [False] * 66 + [True] * 4  # 16 MiB calls: 4

            ids = Reply(prompt_token_ids=tuple(range(MiB)), completion_token_ids=(1, 2), logprobs=(-0.5, -0.25))
            with_ids = turn_value("ep_ids", 0, status=TurnStatus.ANSWERED, reply=ids)
            assert held_bytes(with_ids) == held_bytes(replace(with_ids, reply=None)) + 36 * (MiB + 4)

            small = [turn_value("ep_small", seq, status=TurnStatus.ANSWERED) for seq in range(4100)]
            for turn in small:
                endings.remember(turn)
            assert await kept(endings, [turn.id for turn in small]) == [False] * 4 + [True] * 4096
            assert not any(await kept(endings, [turn.id for turn in huge]))

            # A served episode's prompts: each its parent's ids and 1,000 more (TokenIds), a million ids to begin
            # with. Counted at 36 bytes an id as tuples, 36 MiB a turn, three of them filled the bound; what they hold
            # together is the million ids once, 1,000 more a turn, and a block joined every 64 turns.
            prompts = [TokenIds(range(MiB))]
            for _ in range(149):
                prompts.append(TokenIds.joined(prompts[-1], range(1000)))
            served = [
                turn_value("ep_served", seq, status=TurnStatus.ANSWERED, reply=Reply(prompt_token_ids=ids))
                for seq, ids in enumerate(prompts)
            ]
            at_hand = Endings(OpenTurns(lambda _open_turn: None), store, time.time)
            for turn in served:
                at_hand.remember(turn)
            assert await kept(at_hand, [turn.id for turn in served]) == [True] * 150
            assert held_bytes(served[1]) == held_bytes(replace(served[1], reply=None)) + 8 * 1000

            # A long episode's calls, each the one before with a KiB of messages added (read against it, its parsed
            # messages the same values): each holds its body and what it adds, so that 100 fit, not 64
            long = [
                turn_value(
                    "ep_long",
                    seq,
                    wire=one_mib,
                    status=TurnStatus.ANSWERED,
                    extends=Extension("tu_earlier", seq, MiB - 1024, MiB) if seq else None,
                )
                for seq in range(100)
            ]
            at_hand = Endings(OpenTurns(lambda _open_turn: None), store, time.time)
            for turn in long:
                at_hand.remember(turn)
            assert held_bytes(long[1]) == MiB + 1024
            assert await kept(at_hand, [turn.id for turn in long]) == [True] * 100

            fresh = Endings(OpenTurns(lambda _open_turn: None), store, time.time)
            half_mib = b"x" * (MiB // 2)
            half = [turn_value("ep_half", seq, wire=half_mib, status=TurnStatus.ANSWERED) for seq in range(100)]
            for turn in half:
                fresh.remember(turn)
            for _ in range(60):  # a turn remembered again (its latest state) is counted once
                fresh.remember(half[-1])
            assert await kept(fresh, [turn.id for turn in half]) == [True] * 100  # 100 MiB, within the bound
        finally:
            await store.close()

    asyncio.run(body())


def test_a_settled_turn_stays_at_hand_whatever_its_size_until_its_write_is_done(tmp_path: Path) -> None:
    async def body() -> None:
        path = tmp_path / "endings.db"
        store = SqlStore(f"sqlite:///{path}")
        await store.open()
        open_turns = OpenTurns(lambda _open_turn: None)
        endings = Endings(open_turns, store, time.time)
        episode = episode_value()
        await store.add_episode(episode)
        sixteen_mib = b"x" * 16 * MiB
        parked = [turn_value(episode.id, seq, wire=sixteen_mib) for seq in range(8)]
        for turn in parked:
            await store.add_turn(turn)
        opened = [open_turns.park(turn) for turn in parked]

        other = sqlite3.connect(path, isolation_level=None)  # another process, holding the database's write lock
        other.execute("BEGIN IMMEDIATE")
        try:
            writes = [endings.end([open_turn], TurnStatus.EXPIRED, "no reply") for open_turn in opened]
            # Not recorded yet: the store has each parked, `Endings` as it ended, and no agent has heard
            assert all(stored.status is TurnStatus.PARKED for stored in await store.turns(episode.id))
            assert [(await endings.turn(turn.id)).status for turn in parked] == [TurnStatus.EXPIRED] * 8
            assert not any(open_turn.answer.done() for open_turn in opened)
        finally:
            other.execute("ROLLBACK")
            other.close()
        await asyncio.wait_for(asyncio.gather(*writes), HELD_S)
        assert all(stored.status is TurnStatus.EXPIRED for stored in await store.turns(episode.id))
        assert all(open_turn.answer.done() for open_turn in opened)
        # Recorded: the newest 4 stay at hand (128 MiB of them), the others are read from the store
        with closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("DELETE FROM turn")
        assert await kept(endings, [turn.id for turn in parked]) == [False] * 4 + [True] * 4
        await store.close()

    asyncio.run(body())
