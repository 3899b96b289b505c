"""What one turn costs trajproxy's own code, measured so that two trees can be compared on a busy machine.

    python benchmarks/turn_cost.py [--agents 64] [--rounds 20] [--repeats N] [--no-count]

The app is driven in-process over ASGI, with no server, sockets or load generator: each round, every agent makes
one chat call, the trainer pulls them all (`GET /api/turns/next`) and answers them in one batch
(`POST /api/turns/replies`), the agents get their replies. The collector is set as `trajproxy serve` sets it. It
prints the CPU microseconds per turn (this process, every thread: the writer's SQLite commits included) and, unless
`--no-count`, the instructions per turn as valgrind counts them: a figure that does not move with the machine's
load or clock, which timings on a shared machine do by several percent. Only the measured rounds are counted
(valgrind runs the start-up uninstrumented).

To measure another checkout (a `git worktree` of an older commit, say) with this one's dependencies and script, put
it first on the path: `PYTHONPATH=../older python benchmarks/turn_cost.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import orjson
import uvloop

import proxy
from proxy.app import Trajproxy, create_app
from proxy.settings import Settings

try:
    from proxy.cli.serve import settle_collector
except ImportError:  # older checkouts kept it beside the server
    from proxy.serving import settle_collector  # type: ignore[import-not-found,no-redef]
from turn_load import CHAT, REPLY

COUNTING = "TURN_COST_CALLGRIND"  # set in the run under valgrind: its pid takes the instrumentation commands
App = Callable[[dict[str, Any], Any, Any], Coroutine[Any, Any, None]]


async def call(
    app: App, method: str, path: str, body: bytes = b"", query: bytes = b"", key: str | None = None
) -> tuple[int, bytes]:
    """One HTTP exchange with the app, as a server would hand it over: the body, then a connection that stays open
    until the response is complete."""
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    responded = asyncio.get_running_loop().create_future()
    read = False
    status, chunks = 0, []

    async def receive() -> dict[str, Any]:
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await responded
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    finally:
        if not responded.done():  # a handler that stopped listening for the hang-up cancelled its wait
            responded.set_result(None)
    return status, b"".join(chunks)


class Lifespan:
    """The app's start-up and shutdown, as a server runs them."""

    def __init__(self, app: App) -> None:
        self._app = app
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        started, self._stop = loop.create_future(), loop.create_future()
        messages = [{"type": "lifespan.startup"}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await self._stop
            return {"type": "lifespan.shutdown"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "lifespan.startup.complete":
                started.set_result(None)
            elif message["type"] == "lifespan.startup.failed":
                started.set_exception(RuntimeError(message.get("message", "start-up failed")))

        self._task = asyncio.create_task(self._app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send))
        await started

    async def __aexit__(self, *_exc: object) -> None:
        self._stop.set_result(None)
        assert self._task is not None
        await self._task


def checked(exchange: tuple[int, bytes], status: int = 200) -> bytes:
    if exchange[0] != status:
        raise RuntimeError(f"expected {status}, got {exchange[0]}: {exchange[1][:300]!r}")
    return exchange[1]


async def one_round(app: Trajproxy, keys: list[str]) -> int:
    """Every agent calls once; once all their turns are parked, the trainer pulls them (in one pull, unless one is
    late) and answers them in one batch. The pulls it took."""
    agents = [asyncio.ensure_future(call(app, "POST", "/v1/chat/completions", CHAT, key=key)) for key in keys]
    # The same batch whatever the machine's speed, so that figures repeat: a look at the open turns every 10 ms (it
    # has no event to wait on; each look costs a few instructions, the same in every tree).
    while app.broker.ready_turns < len(keys):  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    turns: list[dict[str, Any]] = []
    pulls = 0
    while len(turns) < len(keys):
        pulls += 1
        turns += orjson.loads(checked(await call(app, "GET", "/api/turns/next", query=b"max=1024&wait=5")))["turns"]
    replies = orjson.dumps({"replies": [{"turn_id": turn["id"], **REPLY} for turn in turns]})
    checked(await call(app, "POST", "/api/turns/replies", replies))
    for agent in agents:
        checked(await agent)
    return pulls


def instrument(on: bool) -> None:
    """Turn valgrind's counting on or off for this process (when it runs under valgrind)."""
    if os.environ.get(COUNTING):
        command = ["callgrind_control", "-i", "on" if on else "off", str(os.getpid())]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


async def measure(agents: int, rounds: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        settings = Settings(
            database_url=f"sqlite:///{folder}/turns.db", lease_s=600, log_level="warning", no_trainer_token=True
        )
        app = create_app(settings)
        async with Lifespan(app):
            created = [await call(app, "POST", "/api/episodes", b'{"task": "bench"}') for _ in range(agents)]
            keys = [orjson.loads(checked(exchange, 201))["key"] for exchange in created]
            settle_collector()
            for _ in range(3):  # warm: the first rounds import and compile what later ones reuse
                await one_round(app, keys)
            instrument(True)
            cpu, pulls = time.process_time(), 0
            for _ in range(rounds):
                pulls += await one_round(app, keys)
            cpu = time.process_time() - cpu
            instrument(False)
    turns = agents * rounds
    return {"turns": turns, "pulls": pulls, "cpu_us": cpu / turns * 1e6}


def counted(agents: int, rounds: int) -> float:
    """Instructions per turn: this script run again under valgrind's callgrind, counting the measured rounds only."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
        command += [sys.executable, __file__, "--agents", str(agents), "--rounds", str(rounds)]
        run = subprocess.run(command, env={**os.environ, COUNTING: "1"}, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise RuntimeError(f"the run under valgrind failed: {run.stderr[-2000:]}")
        turns: int = orjson.loads(run.stdout.splitlines()[-1])["turns"]
        totals = next(line for line in out.read_text().splitlines() if line.startswith("totals:"))
    return int(totals.split()[1]) / turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each figure; the median is shown")
    parser.add_argument("--quick", action="store_true", help="a short smoke: 8 agents, 2 rounds, once")
    parser.add_argument("--no-count", action="store_true", help="leave valgrind out: CPU time only")
    args = parser.parse_args()
    if args.quick:
        args.agents, args.rounds, args.repeats = 8, 2, 1
    if os.environ.get(COUNTING):  # the run under valgrind: its figures, as JSON, for the run that started it
        print(orjson.dumps(uvloop.run(measure(args.agents, args.rounds))).decode())
        return
    counting = not args.no_count and shutil.which("valgrind") is not None
    runs = [uvloop.run(measure(args.agents, args.rounds)) for _ in range(args.repeats)]
    counts = [counted(args.agents, args.rounds) for _ in range(args.repeats)] if counting else [math.nan]
    tree = Path(proxy.__file__).resolve().parent.parent
    print(f"\n### What one turn costs trajproxy's code, in-process (`turn_cost.py`, {tree})\n")
    print("| agents | turns | pulls | CPU µs per turn | instructions per turn |\n|---:|---:|---:|---:|---:|")
    print(
        f"| {args.agents} | {args.agents * args.rounds} | {statistics.median(run['pulls'] for run in runs):.0f} "
        f"| {statistics.median(run['cpu_us'] for run in runs):.1f} | {statistics.median(counts):,.0f} |"
    )
    if not counting:
        print("\ninstructions not counted: " + ("--no-count" if args.no_count else "valgrind is not installed"))


if __name__ == "__main__":
    main()
