"""The ledger keeps the turns settled lately at hand, bounded by their number and by their size: a coding agent's call
can be a megabyte, and 4,096 of them held gigabytes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from proxy.core.errors import NotFound
from proxy.core.ledger import Ledger
from proxy.core.parking import ParkingLot
from proxy.core.values import TurnStatus
from proxy.storage.sql import SqlStore
from tests.test_store import turn_value


async def kept(ledger: Ledger, turn_ids: list[str]) -> list[bool]:
    """Which of the turns the ledger still has at hand (none was ever written, so the store knows none of them)."""
    found = []
    for turn_id in turn_ids:
        try:
            await ledger.turn(turn_id)
            found.append(True)
        except NotFound:
            found.append(False)
    return found


def test_settled_turns_at_hand_are_bounded_by_number_and_by_size(tmp_path: Path) -> None:
    async def body() -> None:
        store = SqlStore(f"sqlite:///{tmp_path}/ledger.db")
        await store.open()
        try:
            ledger = Ledger(ParkingLot(lambda _slot: None), store, time.time)
            big = [turn_value("ep_big", seq, wire=b"x" * 2**20, status=TurnStatus.ANSWERED) for seq in range(100)]
            for turn in big:
                ledger.remember(turn)
            assert await kept(ledger, [turn.id for turn in big]) == [False] * 36 + [True] * 64  # 64 MiB of calls

            huge = [turn_value("ep_huge", seq, wire=b"x" * 2**24, status=TurnStatus.ANSWERED) for seq in range(70)]
            for turn in huge:
                ledger.remember(turn)
            assert await kept(ledger, [turn.id for turn in huge]) == [False] * 6 + [True] * 64  # never fewer than 64

            small = [turn_value("ep_small", seq, status=TurnStatus.ANSWERED) for seq in range(4100)]
            for turn in small:
                ledger.remember(turn)
            assert await kept(ledger, [turn.id for turn in small]) == [False] * 4 + [True] * 4096
            assert not any(await kept(ledger, [turn.id for turn in huge]))

            fresh = Ledger(ParkingLot(lambda _slot: None), store, time.time)
            half = [turn_value("ep_half", seq, wire=b"x" * 2**19, status=TurnStatus.ANSWERED) for seq in range(100)]
            for turn in half:
                fresh.remember(turn)
            for _ in range(60):  # a turn remembered again (its latest state) is counted once
                fresh.remember(half[-1])
            assert await kept(fresh, [turn.id for turn in half]) == [True] * 100  # 50 MiB, within the bound
        finally:
            await store.close()

    asyncio.run(body())
