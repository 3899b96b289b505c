"""Storage: turns recorded per second by the store alone (SqlStore), on SQLite and on Postgres.

    python benchmarks/storage.py --batch 1,64,1024 [--database-url postgresql+psycopg://...]

A turn is recorded as the broker records it: inserted when parked (one write per agent call), then updated
when leased and again when answered (one write per trainer pull, one per batch reply). Each batch of B turns
is B inserts, then one lease update of B rows, then one answer update of B rows, each awaited as the broker
awaits them; the store's writer thread group-commits whatever has queued up. Turns are built before the
clock starts, so what is timed is the store: rows built, statements run, transactions committed.

SQLite runs on a fresh file; Postgres (when --database-url is given) in a scratch schema dropped afterwards.
This process runs pinned to core 0, as trajproxy does; Postgres runs where the system puts it, and the CPU
its processes used is reported next to this process's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).parent))
from harness import SERVER_CORE, cpu_seconds, fresh_database
from turn_load import CHAT, REPLY_MESSAGE, REPLY_USAGE

from proxy.core.values import Episode, EpisodeStatus, Reply, Turn, TurnStatus, Usage, hash_key, new_id, new_key
from proxy.storage.sql import SqlStore

MESSAGE = Reply(message=REPLY_MESSAGE, usage=Usage(**REPLY_USAGE), finish_reason="stop")


def lifecycle(episode_id: str, count: int, first_seq: int) -> tuple[list[Turn], list[Turn], list[Turn]]:
    """`count` turns as parked, as leased and as answered."""
    now = time.time()
    parked = [
        Turn(
            id=new_id("tu"),
            episode_id=episode_id,
            seq=first_seq + i,
            dialect="chat",
            request=orjson.loads(CHAT),
            wire=CHAT,
            stream=False,
            status=TurnStatus.PARKED,
            created_at=now,
            model="policy",
        )
        for i in range(count)
    ]
    leased = [
        replace(turn, status=TurnStatus.LEASED, deliveries=1, lease_id=f"{turn.id}.1", leased_at=now) for turn in parked
    ]
    answered = [
        replace(turn, status=TurnStatus.ANSWERED, lease_id=None, reply=MESSAGE, answered_at=now, ended_at=now)
        for turn in leased
    ]
    return parked, leased, answered


def postgres_cpu_seconds() -> float:
    """CPU seconds used so far by every running postgres process (the server and its backends)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "postgres":
                    total += cpu_seconds(int(entry.name))
            except (OSError, ValueError):  # gone meanwhile
                continue
    return total


async def record(url: str, turns: int, batch: int) -> dict[str, float]:
    store = SqlStore(url)
    await store.open()
    try:
        episode = Episode(
            id=new_id("ep"),
            key_hash=hash_key(new_key()),
            task="storage",
            metadata={},
            status=EpisodeStatus.RUNNING,
            created_at=time.time(),
        )
        await store.add_episode(episode)
        batches = [lifecycle(episode.id, min(batch, turns - first), first) for first in range(0, turns, batch)]
        postgres = url.startswith("postgresql")
        cpu, db_cpu, wall = time.process_time(), postgres_cpu_seconds() if postgres else 0.0, time.perf_counter()
        for parked, leased, answered in batches:
            await asyncio.gather(*(store.add_turn(turn) for turn in parked))
            await store.save_turns(leased)
            await store.save_turns(answered)
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu
        db_cpu = postgres_cpu_seconds() - db_cpu if postgres else float("nan")
    finally:
        await store.close()
    return {
        "batch": batch,
        "turns": turns,
        "turns_per_s": turns / wall,
        "us_per_turn": wall / turns * 1e6,
        "store_cpu": cpu / wall,  # this process: the event loop and the writer thread
        "db_cpu": db_cpu / wall,  # the Postgres server's processes (nan for SQLite)
    }


def bench(database_url: str | None, turns: int, batch: int) -> dict[str, float]:
    """One run on a fresh SQLite file (no `database_url`), or in a scratch schema of the Postgres at the URL."""
    with fresh_database(database_url) as url:
        return asyncio.run(record(url, turns, batch))


def turns_for(batch: int, most: int) -> int:
    """Enough turns for a steady figure without waiting minutes on one-turn transactions."""
    return min(most, max(500, batch * 100))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--batch", default="1,64,1024", help="comma-separated batch sizes (turns per pull)")
    parser.add_argument("--turns", type=int, default=20000, help="the most turns recorded per figure")
    parser.add_argument("--database-url", help="also run on this Postgres (a scratch schema, dropped after)")
    parser.add_argument("--quick", action="store_true", help="a short smoke: batches of 64, 640 turns")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.turns = "64", 640
    os.sched_setaffinity(0, {SERVER_CORE})
    backends: list[tuple[str, str | None]] = [("sqlite", None)]
    if args.database_url:
        backends.append(("postgres", args.database_url))
    print("backend   batch  turns  turns/s  µs/turn  store cpu  db cpu", flush=True)
    for name, url in backends:
        for batch in (int(n) for n in args.batch.split(",")):
            r = bench(url, turns_for(batch, args.turns), batch)
            db = "-" if url is None else f"{r['db_cpu']:.0%}"
            print(
                f"{name:<8}  {batch:>5}  {r['turns']:>5}  {r['turns_per_s']:>7.0f}  {r['us_per_turn']:>7.0f}  "
                f"{r['store_cpu']:>9.0%}  {db:>6}",
                flush=True,
            )


if __name__ == "__main__":
    main()
