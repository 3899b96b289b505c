"""Turn throughput and latency: N agents each sending chat completions in a loop through trajproxy, one trainer
pulling them in batches and answering each batch in one call. Every turn is durably recorded.

    python benchmarks/turns.py --agents 1,16,64,256 --seconds 10 [--database-url URL] [--trainer http,ws]
        [--server uvicorn,granian] [--floor]

The trainer takes its turns one of three ways (`--trainer`, several in one run): `http` pulls a batch and answers
it in a second call, `reply-pull` answers and pulls the next batch in one call, `ws` is pushed turns on the
WebSocket stream and sends each batch's replies back on it without waiting for the acknowledgement.

trajproxy runs pinned to core 0 (`taskset`), this load generator to core 1, so the two never share a core;
the CPU each used is printed next to the figures, to show which one was the limit. With several `--server`s (the
HTTP server in front of the app) each figure is taken on each in turn, interleaved, so drift on a shared machine
falls on all of them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from websockets.asyncio.client import connect

sys.path.insert(0, str(Path(__file__).parent))
from harness import HOST, cpu_seconds, percentile, pin_load, start_server
from lean_http import Connection, request

CHAT = orjson.dumps(
    {
        "model": "policy",
        "messages": [
            {"role": "system", "content": "You are a coding agent. " * 8},
            {"role": "user", "content": "Fix the failing test in calc.py. " * 8},
        ],
    }
)
TRAINERS = ("http", "reply-pull", "ws")
REPLY_MESSAGE = {"content": "Let me look at the code first."}
REPLY_USAGE = {"prompt_tokens": 90, "completion_tokens": 8}
REPLY = {"message": REPLY_MESSAGE, "usage": REPLY_USAGE}


@dataclass
class Run:
    agents: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    turns: int = 0
    errors: int = 0
    measuring: bool = False
    stop: bool = False
    trainer: str = "http"  # or "reply-pull" (POST /api/turns/replies?pull=N), or "ws" (/api/turns/stream)


async def agent(port: int, key: str, run: Run) -> None:
    call = request("POST", "/v1/chat/completions", HOST, CHAT, {"authorization": f"Bearer {key}"})
    connection = await Connection.open(HOST, port)
    try:
        while not run.stop:
            started = time.perf_counter()
            status, _ = await connection.send(call)
            if run.measuring:
                if status == 200:
                    run.latencies.append(time.perf_counter() - started)
                    run.turns += 1
                else:
                    run.errors += 1
    finally:
        connection.close()


async def trainer(port: int, run: Run, agents_done: asyncio.Event) -> None:
    """Pull a batch, answer it in one call; with `reply-pull`, that call also pulls the next batch."""
    if run.trainer == "ws":
        await stream_trainer(port, run, agents_done)
        return
    pulls = await Connection.open(HOST, port)
    replies = await Connection.open(HOST, port)
    pull = request("GET", "/api/turns/next?max=1024&wait=0.5", HOST)
    answer = "/api/turns/replies?pull=1024&wait=0.5" if run.trainer == "reply-pull" else "/api/turns/replies"
    turns: list[Any] = []
    while not agents_done.is_set():
        if not turns:
            status, body = await pulls.send(pull)
            turns = orjson.loads(body)["turns"] if status == 200 else []
            continue
        batch = orjson.dumps({"replies": [{"turn_id": turn["id"], **REPLY} for turn in turns]})
        status, body = await replies.send(request("POST", answer, HOST, batch))
        if status != 200:
            run.errors += len(turns)
        turns = orjson.loads(body).get("turns", []) if status == 200 else []
    pulls.close()
    replies.close()


async def stream_trainer(port: int, run: Run, agents_done: asyncio.Event) -> None:
    """Answer each batch the stream pushes as it comes; acknowledgements are counted as they come back."""
    url = f"ws://{HOST}:{port}/api/turns/stream?max=1024"
    async with connect(url, compression=None, proxy=None, max_size=None) as socket:
        while not agents_done.is_set():
            try:
                message = orjson.loads(await asyncio.wait_for(socket.recv(), 0.5))
            except TimeoutError:
                continue
            if message["type"] == "turns":
                replies = [{"turn_id": turn["id"], **REPLY} for turn in message["turns"]]
                await socket.send(orjson.dumps({"replies": replies}).decode())
            elif message["type"] == "results":
                run.errors += sum(result["status"] != 200 for result in message["results"])
            else:
                run.errors += 1


async def measure(
    port: int,
    agents: int,
    seconds: float,
    warmup_s: float,
    trainer_kind: str = "http",
    trainer_port: int | None = None,
    on_window: Callable[[bool], object] | None = None,
) -> Run:
    """Agents call on `port`; the trainer (`trainer_kind`) pulls and answers on `trainer_port` (default: the same).
    `on_window(True)` is called as the measured seconds begin, `on_window(False)` as they end."""
    trainer_port = trainer_port or port
    async with httpx.AsyncClient(base_url=f"http://{HOST}:{trainer_port}") as http:
        keys = [(await http.post("/api/episodes", json={"task": "bench"})).json()["key"] for _ in range(agents)]
    run = Run(agents, seconds, trainer=trainer_kind)
    done = asyncio.Event()
    serving = asyncio.create_task(trainer(trainer_port, run, done))
    working = [asyncio.create_task(agent(port, key, run)) for key in keys]
    await asyncio.sleep(warmup_s)
    run.measuring = True
    if on_window:
        on_window(True)
    await asyncio.sleep(seconds)
    run.measuring = False
    if on_window:
        on_window(False)
    run.stop = True
    await asyncio.gather(*working)
    done.set()
    await serving
    return run


def bench(
    agents: int,
    seconds: float,
    warmup_s: float,
    database_url: str,
    port: int,
    profile: str | None = None,
    trainer_kind: str = "http",
    front: str | None = None,
) -> dict[str, float]:
    server = start_server(port, database_url, profile, flags=["--server", front] if front else [])
    return measured(server, agents, seconds, measure(port, agents, seconds, warmup_s, trainer_kind))


def measured(
    server: subprocess.Popen[bytes],
    agents: int,
    seconds: float,
    load: Coroutine[Any, Any, Run],
    stop: signal.Signals = signal.SIGINT,
) -> dict[str, float]:
    """Run the load against the server, then stop the server with `stop` (killed if it has not stopped in 30 s);
    the figures, with the CPU each side used."""
    try:
        load_cpu, server_cpu, wall = time.process_time(), cpu_seconds(server.pid), time.perf_counter()
        run = asyncio.run(load)
        wall = time.perf_counter() - wall
        load_cpu, server_cpu = time.process_time() - load_cpu, cpu_seconds(server.pid) - server_cpu
    finally:
        server.send_signal(stop)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return {
        "agents": agents,
        "turns_per_s": run.turns / seconds,
        "p50_ms": percentile(run.latencies, 50) * 1000,
        "p99_ms": percentile(run.latencies, 99) * 1000,
        "errors": run.errors,
        "server_cpu": server_cpu / wall,  # of one core, over the whole run (set-up and warm-up included)
        "load_cpu": load_cpu / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--agents", default="1,16,64,256", help="comma-separated agent counts")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--database-url", help="default: a fresh SQLite file per run")
    parser.add_argument("--port", type=int, default=18500)
    parser.add_argument("--profile", help="record the server with py-spy into this file (raw, for flamegraph.pl)")
    parser.add_argument("--floor", action="store_true", help="after each figure, the floor's (benchmarks/floor.py)")
    parser.add_argument(
        "--trainer",
        default="http",
        help="comma-separated, each run in turn: http (pull, then reply), reply-pull (one call), ws (the stream)",
    )
    parser.add_argument("--one-exchange", action="store_true", help="the same as --trainer reply-pull")
    parser.add_argument("--server", help="comma-separated HTTP servers in front, each in turn: uvicorn, granian")
    args = parser.parse_args()
    kinds = ["reply-pull"] if args.one_exchange else args.trainer.split(",")
    if unknown := set(kinds) - set(TRAINERS):
        parser.error(f"--trainer: unknown {', '.join(sorted(unknown))}; one or more of {', '.join(TRAINERS)}")
    pin_load()
    print("agents  trainer     server     turns/s  p50 ms  p99 ms  errors  server cpu  load cpu  of floor", flush=True)
    failed = False
    for agents in (int(n) for n in args.agents.split(",")):
        for kind in kinds:
            failed |= compare(args, agents, kind)
    sys.exit(1 if failed else 0)


def compare(args: argparse.Namespace, agents: int, kind: str) -> bool:
    """One figure, and the floor's next to it with --floor (whose trainer replies and pulls in one call where
    trajproxy's streams: it has no stream); whether it failed."""
    rows = []
    for front in args.server.split(",") if args.server else [None]:
        with tempfile.TemporaryDirectory() as folder:
            url = args.database_url or f"sqlite:///{folder}/bench.db"
            result = bench(agents, args.seconds, args.warmup_s, url, args.port, args.profile, kind, front)
        rows.append((front or "trajproxy", result))
    if args.floor:
        import floor

        floor_kind = "reply-pull" if kind == "ws" else kind
        rows.append(("floor", floor.bench(agents, args.seconds, args.warmup_s, args.port + 1, floor_kind)))
    for server, figures in rows:
        ratio = f"{figures['turns_per_s'] / rows[-1][1]['turns_per_s']:.2f}x" if args.floor else "-"
        print(
            f"{agents:>6}  {kind:<10}  {server:<9}  {figures['turns_per_s']:>7.0f}  {figures['p50_ms']:>6.2f}  "
            f"{figures['p99_ms']:>6.2f}  {figures['errors']:>6}  {figures['server_cpu']:>9.0%}  "
            f"{figures['load_cpu']:>8.0%}  {ratio:>8}",
            flush=True,
        )
    return any(bool(figures["errors"]) or not figures["turns_per_s"] for name, figures in rows if name != "floor")


if __name__ == "__main__":
    main()
