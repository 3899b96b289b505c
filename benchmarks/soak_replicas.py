"""A soak of three `trajproxy serve --shared` replicas behind HAProxy: agents call through the balancer in loops, a
replica is killed -9 every 30 s and started again, and at the end every call the agents made is matched against the
database: each answered once, by one turn.

    python benchmarks/soak_replicas.py --database-url URL [--minutes 5] [--agents 256] [--every-s 30] [--quick]

Agents behave as the SDKs do: a call that fails with a dropped connection, a truncated stream or the balancer's
502/503 is sent again with the same body and `x-stainless-retry-count` one higher, after a short backoff, so a call
parked on a killed replica is attached to its turn by whichever replica the retry reaches. The trainer (soak.py's,
a process of its own, answering "re: <text>") pulls through the balancer too; when the replica behind its
connection dies it exits and is started again, and the turns it had leased come back when their 2 s lease runs out.
Accounted at the end (soak_ledger.account): no call lost (each one answered, with its own text, by the one turn the
database holds for it), none duplicated, no turn unknown to the agents or left open. Each run gets a database of its
own on the Postgres server at URL. Exits 1 if anything is off, and then prints the evidence: for each call lost,
the row of its turn (status, held_for, holder, deliveries, when it was created, leased, ended), and when each replica
lived.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import sqlalchemy

sys.path.insert(0, str(Path(__file__).parent))
from harness import HOST, exit_on_sigterm, own_database, raise_open_files, unpin
from lean_http import Connection, request
from replica_set import SHARED, NoBalancer, Replica, balancer, count_turns, replica_set
from soak import KEEPALIVE_S, LEASE_S, RETRY_GRACE_S, STREAM_P, TURN_TIMEOUT_S, Trainer, chat, content_of, episodes
from soak_ledger import Call, Row, account, recorded

from proxy.storage.engines import engine_url
from proxy.storage.stored_turns import wire_bodies

REPLICAS = 3
FAILED_OVER = (502, 503)  # the balancer's: the replica died under the call, or none was up for a moment
MAX_ATTEMPTS = 12  # an SDK configured for a flaky network; each backoff 0.5 to 2 s


@dataclass
class Soak:
    port: int  # the balancer's
    agents: int
    think_s: float
    calls: list[Call] = field(default_factory=list)
    failovers: int = 0  # attempts cut by a kill, and retried
    kills: int = 0
    trainer_restarts: int = 0
    lives: list[tuple[float, str, str]] = field(default_factory=list)  # (time, "up", "killed" or "trainer", replica)
    stopped_at: float = 0.0  # when the agents stopped making calls (those in flight go on)
    stopping: bool = False
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # set with `stopping`, for those that wait on it


async def attempt(port: int, key: str, body: bytes, retry: int) -> tuple[int, bytes]:
    """One attempt of a call, on a connection of its own; status 0 if the connection broke or the stream was cut."""
    headers = {"authorization": f"Bearer {key}", "x-stainless-retry-count": str(retry)}
    try:
        connection = await Connection.open(HOST, port)
    except OSError:
        return 0, b""
    try:
        sent = connection.send(request("POST", "/v1/chat/completions", HOST, body, headers))
        return await asyncio.wait_for(sent, TURN_TIMEOUT_S + 30)
    except (OSError, EOFError, IndexError, ValueError):  # reset, truncated, or no status line at all
        return 0, b""
    finally:
        connection.close()


async def call(soak: Soak, rng: random.Random, key: str, record: Call) -> None:
    """One call, sent again as an SDK would until it is answered (or MAX_ATTEMPTS are spent)."""
    stream = rng.random() < STREAM_P
    body = chat(record.text, stream)
    while record.attempts < MAX_ATTEMPTS:
        status, answer = await attempt(soak.port, key, body, record.attempts)
        record.attempts += 1
        if status == 200:
            try:
                content = content_of(answer, stream)
            except ValueError:  # a stream cut between two events
                status = 0
            else:
                record.outcome, record.content = "answered", content
                return
        if status not in (0, *FAILED_OVER):
            record.outcome = "expired" if status == 504 else f"error {status}"
            return
        soak.failovers += 1
        await asyncio.sleep(rng.uniform(0.5, 2.0))
    record.outcome = "gave up"


async def api_post(api: httpx.AsyncClient, path: str, body: dict[str, str]) -> dict[str, Any]:
    """A trainer API call through the balancer, tried again while a replica is down."""
    for _ in range(20):
        with contextlib.suppress(httpx.TransportError):
            response = await api.post(path, json=body)
            if response.status_code not in FAILED_OVER:
                response.raise_for_status()
                return dict(response.json())
        await asyncio.sleep(0.5)
    raise RuntimeError(f"POST {path} failed through the balancer 20 times")


async def chaos(replicas: list[Replica], soak: Soak, every_s: float) -> None:
    """Kill -9 a replica (chosen at random) every `every_s` from the start, and start it again at once; returns when
    the soak stops (a replica being started is waited for)."""
    rng = random.Random(-1)
    next_kill_s = time.monotonic() + every_s
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(soak.stopped.wait(), max(0.0, next_kill_s - time.monotonic()))
            return
        victim = rng.choice(replicas)
        killed = await replica_id(victim)
        victim.kill()
        soak.lives.append((time.time(), "killed", killed))
        soak.kills += 1
        await asyncio.to_thread(victim.start)
        soak.lives.append((time.time(), "up", await replica_id(victim)))
        next_kill_s += every_s


async def replica_id(replica: Replica) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        return str((await client.get(f"http://{HOST}:{replica.port}/health")).json()["replica"])


async def keep_training(trainer: Trainer, soak: Soak, agents: list[asyncio.Task[None]]) -> None:
    """Start the trainer again whenever it exits (its connection went with a killed replica), until no agent waits
    for an answer: the soak's last kill may come as it stops, and calls are still parked then."""
    while not all(agent.done() for agent in agents):
        if trainer.process.poll() is not None:
            trainer.restart()
            soak.trainer_restarts += 1
            soak.lives.append((time.time(), "trainer", ""))
        await asyncio.sleep(0.2)


async def soak_run(soak: Soak, replicas: list[Replica], trainer: Trainer, seconds: float, every_s: float) -> None:
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(base_url=f"http://{HOST}:{soak.port}", limits=limits, timeout=60) as api:
        post = functools.partial(api_post, api)
        agents = [
            asyncio.create_task(episodes(soak, n, post, functools.partial(call, soak))) for n in range(soak.agents)
        ]
        background = [
            asyncio.create_task(chaos(replicas, soak, every_s)),
            asyncio.create_task(keep_training(trainer, soak, agents)),
        ]
        await asyncio.sleep(seconds)
        soak.stopping, soak.stopped_at = True, time.time()
        soak.stopped.set()
        done, pending = await asyncio.wait(agents, timeout=TURN_TIMEOUT_S + 60)
        for task in pending:
            task.cancel()
        for task in background:
            await task
        for task in done:
            error = task.exception()
            if error is not None:
                raise error


def drained(database_url: str, timeout_s: float) -> bool:
    """Wait until no turn is open (retry graces and leases have run out)."""
    deadline = time.monotonic() + timeout_s
    while count_turns(database_url, "status IN ('parked', 'leased')"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def run(postgres_url: str, base_port: int, agents: int, seconds: float, think_s: float, every_s: float) -> int:
    flags = [SHARED, "--retry-grace-s", str(RETRY_GRACE_S), "--keepalive-s", str(KEEPALIVE_S)]
    flags += ["--turn-timeout-s", str(TURN_TIMEOUT_S)]
    files, replicas_from = 4 * agents + 1024, base_port + 1 if base_port else 0
    with own_database(postgres_url) as url, replica_set(REPLICAS, url, flags, files, replicas_from) as replicas:
        with balancer([replica.port for replica in replicas], base_port) as (_, port):
            print(
                f"soak: {agents} agents for {seconds / 60:.1f} min through HAProxy on {REPLICAS} replicas sharing "
                f"{url.split('@')[-1]}; a replica is killed -9 every {every_s:g} s and started again",
                flush=True,
            )
            soak = Soak(port, agents, think_s)
            soak.lives += [(time.time(), "up", asyncio.run(replica_id(replica))) for replica in replicas]
            trainer = Trainer(port, quiet=True)
            try:
                asyncio.run(soak_run(soak, replicas, trainer, seconds, every_s))
                settled = drained(url, RETRY_GRACE_S + LEASE_S + 60)
            finally:
                trainer.kill()
        complained = sum(replica.complaints.count for replica in replicas)
        complaints = "".join(replica.complaints.last() for replica in replicas if replica.complaints.count)
        turns = recorded(url)
        code = report(soak, turns, seconds, settled, complained, complaints)
        if code:
            explain(soak, url)
    return code


def report(soak: Soak, turns: list[Row], seconds: float, settled: bool, complained: int, complaints: str) -> int:
    figures, cases = account(soak.calls, turns)
    outcomes = Counter(call.outcome for call in soak.calls)
    unanswered = len(soak.calls) - outcomes["answered"]
    statuses = Counter(turn.status for turn in turns)
    print(
        f"faults injected: {soak.kills} replicas killed -9 (and started again), {soak.failovers} attempts cut and "
        f"sent again, {soak.trainer_restarts} trainer restarts"
    )
    since_stop = {
        event: ", ".join(f"{when - soak.stopped_at:+.1f}" for when, what, _ in soak.lives if what == event) or "none"
        for event in ("killed", "trainer")
    }
    print(f"seconds from the stop: kills {since_stop['killed']}; trainer restarts {since_stop['trainer']}")
    print(
        f"calls: {len(soak.calls)} ({outcomes['answered']} answered, {unanswered} not: "
        + (", ".join(f"{n} {outcome}" for outcome, n in outcomes.items() if outcome != "answered") or "none")
        + f"); {len(soak.calls) / seconds:.0f} calls/s"
    )
    print("turns: " + f"{len(turns)} recorded (" + ", ".join(f"{n} {s}" for s, n in statuses.most_common()) + ")")
    lost = figures["lost"] + unanswered
    print(
        f"lost {lost}, duplicated {figures['duplicated']}, unknown {figures['unknown']}, "
        f"left open {figures['open']}, seq gaps {figures['gaps']}; drained: {settled}"
    )
    for case in cases[:10]:
        print(f"  {case}")
    print(f"replica errors logged during the run: {complained}")
    if complained:
        print(complaints[-3000:])
    return 1 if lost or any(figures.values()) or not settled else 0


_LOST = """SELECT id, seq, status, held_for, replica, deliveries, created_at, leased_at, lease_expires_at, ended_at,
    reason, base_id, whole_seq, wire_parts, request_parts, episode_id FROM turn WHERE episode_id = ANY(:episodes)"""


def explain(soak: Soak, database_url: str, most: int = 20) -> None:
    """What the database holds for each call lost (the turn's row, times from the start of the run) and when the
    replicas lived: the evidence to find why its agent was never answered."""
    lost = {c.text: c for c in soak.calls if c.outcome != "answered" or c.content != f"re: {c.text}"}
    engine = sqlalchemy.create_engine(engine_url(database_url))
    try:
        with engine.connect() as conn:
            episodes = list({c.episode_id for c in lost.values()})
            rows = conn.execute(sqlalchemy.text(_LOST), {"episodes": episodes}).all()
            wires = dict(zip((row.id for row in rows), wire_bodies(conn, rows), strict=True))
    finally:
        engine.dispose()
    start = soak.lives[0][0]
    ends = {replica: when - start for when, event, replica in soak.lives if event == "killed"}
    lived = {replica: (when - start, ends.get(replica)) for when, event, replica in soak.lives if event == "up"}

    def at(t: float | None) -> str:
        return "-" if t is None else f"{t - start:.1f}"

    mine = [
        (row, lost[text]) for row in rows if (text := orjson.loads(wires[row.id])["messages"][-1]["content"]) in lost
    ]
    kinds = Counter((row.status, row.held_for, "killed" if row.replica in ends else "alive") for row, _ in mine)
    print("lost turns by (status, held_for, holder): " + ", ".join(f"{n} {k}" for k, n in kinds.most_common()))
    print(f"times in s from the start; the agents stopped calling at {at(soak.stopped_at)}")
    for row, record in sorted(mine, key=lambda pair: pair[0].created_at)[:most]:
        print(
            f"  {row.id} seq {row.seq}: {row.status} held_for={row.held_for} replica={row.replica} "
            f"deliveries={row.deliveries} created {at(row.created_at)} leased {at(row.leased_at)} lease ends "
            f"{at(row.lease_expires_at)} ended {at(row.ended_at)} ({row.reason}); agent: {record.outcome} after "
            f"{record.attempts} attempts"
        )
    print(
        "replicas (up-killed): "
        + ", ".join(f"{r} {up:.1f}-{'' if end is None else f'{end:.1f}'}" for r, (up, end) in lived.items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--database-url", required=True, help="a Postgres server (the run makes a database there)")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--agents", type=int, default=256)
    parser.add_argument("--every-s", type=float, default=30.0, help="seconds between two kills")
    parser.add_argument("--think-s", type=float, default=1.0, help="mean pause between an agent's calls")
    parser.add_argument("--quick", action="store_true", help="a smoke: 64 agents for 16 s, a kill every 5 s")
    parser.add_argument("--port", type=int, default=0, help="the balancer's, replicas' the next (default: free ones)")
    args = parser.parse_args()
    unpin()  # replicas, HAProxy and the load share the machine (see the docstring)
    exit_on_sigterm()
    seconds = 16.0 if args.quick else args.minutes * 60
    agents, every_s = (64, 5.0) if args.quick else (args.agents, args.every_s)
    raise_open_files(8 * agents + 1024)
    try:
        sys.exit(run(args.database_url, args.port, agents, seconds, args.think_s, every_s))
    except NoBalancer as e:
        sys.exit(f"soak_replicas.py: {e}")


if __name__ == "__main__":
    main()
