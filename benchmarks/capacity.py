"""Capacity: how many agent calls one trajproxy process holds parked at once, and what they cost it in memory.

    python benchmarks/capacity.py --calls 10000,16384 [--database-url URL]

Each call is one agent of its own episode sending a ~2 KB chat completion on its own connection. No trainer
answers until every call is parked (GET /health counts them); then one trainer pulls them in batches of up to
4096 and answers each batch in one call, until every agent has its 200. The server's memory is read from
/proc/<pid>/status (VmHWM, the peak resident set, and VmRSS, the resident set now). trajproxy runs pinned to
core 0, the agents and the trainer in this process on core 1; both get an open-file limit above the count.
Agents connect --connect-at-once at a time; the connections the kernel dropped meanwhile because trajproxy's
listen queue was full are counted ("overflows", from /proc/net/netstat): each cost its agent a SYN retry.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).parent))
from harness import HOST, cpu_seconds, fresh_database, pin_load, raise_open_files, start_server
from lean_http import Connection, request

CHAT = orjson.dumps(
    {
        "model": "policy",
        "messages": [
            {"role": "system", "content": "You are a coding agent working in a repository. " * 20},
            {"role": "user", "content": "Fix the failing test in calc.py and run the suite again. " * 18},
        ],
    }
)
REPLY = {
    "message": {"content": "Let me look at the code first."},
    "usage": {"prompt_tokens": 480, "completion_tokens": 8},
}
SPARE_FILES = 4096  # above the call count: the database, the listening sockets, the trainer's connections


@dataclass
class Calls:
    count: int
    answered: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    connect_s: list[float] = field(default_factory=list)
    all_answered: asyncio.Event = field(default_factory=asyncio.Event)

    def fail(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
        self._settled()

    def answer(self) -> None:
        self.answered += 1
        self._settled()

    def _settled(self) -> None:
        if self.answered + self.errors == self.count:
            self.all_answered.set()


def listen_overflows() -> int:
    """Connections the kernel dropped because a listen queue was full (all of this network namespace)."""
    names, values = (line.split() for line in Path("/proc/net/netstat").read_text().splitlines()[:2])
    return int(values[names.index("ListenOverflows")])


def memory_kib(pid: int) -> dict[str, int]:
    """VmHWM and VmRSS of a process, in KiB."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmHWM", "VmRSS"))}


async def create_episodes(port: int, count: int, connections: int = 16) -> list[str]:
    keys: list[str] = []
    call = request("POST", "/api/episodes", HOST, orjson.dumps({"task": "capacity"}))

    async def worker(share: int) -> None:
        connection = await Connection.open(HOST, port)
        for _ in range(share):
            status, body = await connection.send(call)
            if status != 201:
                raise RuntimeError(f"POST /api/episodes answered {status}: {body[:200]!r}")
            keys.append(orjson.loads(body)["key"])
        connection.close()

    await asyncio.gather(*(worker(count // connections + (i < count % connections)) for i in range(connections)))
    return keys


async def call_agent(port: int, key: str, connecting: asyncio.Semaphore, calls: Calls) -> None:
    """One agent's one call, held open until it is answered."""
    chat = request("POST", "/v1/chat/completions", HOST, CHAT, {"authorization": f"Bearer {key}"})
    try:
        async with connecting:
            started = time.perf_counter()
            connection = await Connection.open(HOST, port)
            calls.connect_s.append(time.perf_counter() - started)
        try:
            status, _ = await connection.send(chat)
        finally:
            connection.close()
    except OSError as e:
        calls.fail(type(e).__name__)
        return
    if status == 200:
        calls.answer()
    else:
        calls.fail(f"HTTP {status}")


async def wait_parked(port: int, calls: Calls, timeout_s: float) -> int:
    """Poll /health until every call is parked (or has failed); returns how many are parked."""
    health = await Connection.open(HOST, port)
    probe = request("GET", "/health", HOST)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            parked = int(orjson.loads((await health.send(probe))[1])["open_turns"])
            if parked + calls.errors >= calls.count or time.monotonic() > deadline:
                return parked
            await asyncio.sleep(0.05)
    finally:
        health.close()


async def drain(port: int, calls: Calls, batch: int, reply: dict[str, Any]) -> None:
    """Pull parked turns in batches and answer each batch in one call, until every agent has its answer."""
    pulls, replies = await Connection.open(HOST, port), await Connection.open(HOST, port)
    pull = request("GET", f"/api/turns/next?max={batch}&wait=0.5", HOST)
    try:
        while not calls.all_answered.is_set():
            status, body = await pulls.send(pull)
            turns = orjson.loads(body)["turns"] if status == 200 else []
            if turns:
                answers = orjson.dumps({"replies": [{"turn_id": turn["id"], **reply} for turn in turns]})
                status, _ = await replies.send(request("POST", "/api/turns/replies", HOST, answers))
                if status != 200:
                    raise RuntimeError(f"POST /api/turns/replies answered {status}")
    finally:
        pulls.close()
        replies.close()


async def measure(
    port: int, pid: int, count: int, batch: int, connect_at_once: int, timeout_s: float, reply: dict[str, Any]
) -> dict[str, float | str]:
    started = time.perf_counter()
    keys = await create_episodes(port, count)
    episodes_s = time.perf_counter() - started
    idle = memory_kib(pid)
    calls = Calls(count)
    connecting = asyncio.Semaphore(connect_at_once)
    server_cpu, load_cpu, overflows = cpu_seconds(pid), time.process_time(), listen_overflows()
    started = time.perf_counter()
    agents = [asyncio.create_task(call_agent(port, key, connecting, calls)) for key in keys]
    parked = await wait_parked(port, calls, timeout_s)
    park_s = time.perf_counter() - started
    held = memory_kib(pid)
    overflows = listen_overflows() - overflows
    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(drain(port, calls, batch, reply), calls.all_answered.wait()), timeout_s)
    drain_s = time.perf_counter() - started
    await asyncio.gather(*agents)
    wall = park_s + drain_s
    server_cpu, load_cpu = cpu_seconds(pid) - server_cpu, time.process_time() - load_cpu
    return {
        "calls": count,
        "parked": parked,
        "errors": calls.errors,
        "error_kinds": ", ".join(f"{kind}: {n}" for kind, n in calls.error_kinds.items()),
        "episodes_s": episodes_s,
        "park_s": park_s,
        "listen_overflows": overflows,  # each one costs its agent a SYN retry (1 s, then 2 s, ...)
        "slowest_connect_s": max(calls.connect_s, default=0.0),
        "drain_s": drain_s,
        "idle_rss_mib": idle["VmRSS"] / 1024,
        "parked_rss_mib": held["VmRSS"] / 1024,
        "peak_rss_mib": memory_kib(pid)["VmHWM"] / 1024,
        "kib_per_call": (held["VmRSS"] - idle["VmRSS"]) / count,
        "server_cpu": server_cpu / wall,  # of one core, from the first call to the last answer
        "load_cpu": load_cpu / wall,
    }


def bench(
    count: int,
    database_url: str | None,
    port: int,
    *,
    batch: int = 4096,
    connect_at_once: int = 1024,
    timeout_s: float = 300.0,
    usage: bool = True,
) -> dict[str, float | str]:
    raise_open_files(count + SPARE_FILES)
    with fresh_database(database_url) as url:
        flags = ["--turn-timeout-s", str(timeout_s * 3)]
        server = start_server(port, url, flags=flags, open_files=count + SPARE_FILES)
        try:
            reply = REPLY if usage else {"message": REPLY["message"]}  # without usage, trajproxy counts the tokens
            return asyncio.run(measure(port, server.pid, count, batch, connect_at_once, timeout_s, reply))
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--calls", default="10000,16384", help="comma-separated counts of calls parked at once")
    parser.add_argument("--batch", type=int, default=4096, help="the most turns the trainer pulls at once")
    parser.add_argument("--connect-at-once", type=int, default=1024, help="agents connecting at the same time")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="give up parking (or draining) after this")
    parser.add_argument("--database-url", help="a Postgres (a scratch schema per run; default: a fresh SQLite file)")
    parser.add_argument("--port", type=int, default=18700)
    parser.add_argument("--quick", action="store_true", help="a short smoke: 1000 calls")
    parser.add_argument(
        "--without-usage", action="store_true", help="replies carry no usage: trajproxy loads an encoding and counts"
    )
    args = parser.parse_args()
    if args.quick:
        args.calls = "1000"
    pin_load()
    print(
        "calls  parked  errors  park s  overflows  slowest connect s  drain s  idle MiB  parked MiB  peak MiB  "
        "KiB/call  server cpu  load cpu",
        flush=True,
    )
    failed = False
    for count in (int(n) for n in args.calls.split(",")):
        r = bench(
            count,
            args.database_url,
            args.port,
            batch=args.batch,
            connect_at_once=args.connect_at_once,
            timeout_s=args.timeout_s,
            usage=not args.without_usage,
        )
        print(
            f"{count:>5}  {r['parked']:>6}  {r['errors']:>6}  {r['park_s']:>6.2f}  "
            f"{r['listen_overflows']:>9}  {r['slowest_connect_s']:>17.1f}  "
            f"{r['drain_s']:>7.2f}  "
            f"{r['idle_rss_mib']:>8.0f}  {r['parked_rss_mib']:>10.0f}  {r['peak_rss_mib']:>8.0f}  "
            f"{r['kib_per_call']:>8.1f}  {r['server_cpu']:>10.0%}  {r['load_cpu']:>8.0%}",
            flush=True,
        )
        if r["errors"]:
            print(f"       errors: {r['error_kinds']}", flush=True)
        parked = r["parked"]
        assert isinstance(parked, int)
        failed |= bool(r["errors"]) or parked < count
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
