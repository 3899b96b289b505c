"""The load the turn benchmarks put on a server: N agents each sending chat completions in a loop, one trainer
pulling their turns in batches and answering them (`measure`), and the figures it gives (`measured`). The same
load drives trajproxy (`turns.py`) and the floor (`floor.py`).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from harness import HOST, cpu_seconds, percentile
from lean_http import Connection, request
from websockets.asyncio.client import connect

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
NO_TURN = {"turn_id": "tu_none", **REPLY}  # what a reply-pull with nothing to answer sends: refused, 404, alone


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
    """Pull a batch, answer it in one call; with `reply-pull`, that call also pulls the next batch, and every pull
    rides on a reply (with nothing to answer, a reply to no turn): its figures are never the plain pull's."""
    if run.trainer == "ws":
        await stream_trainer(port, run, agents_done)
        return
    pulls = await Connection.open(HOST, port)
    replies = await Connection.open(HOST, port)
    pull = request("GET", "/api/turns/next?max=1024&wait=0.5", HOST)
    one_exchange = run.trainer == "reply-pull"
    answer = "/api/turns/replies?pull=1024&wait=0.5" if one_exchange else "/api/turns/replies"
    turns: list[Any] = []
    while not agents_done.is_set():
        if not turns and not one_exchange:
            status, body = await pulls.send(pull)
            turns = orjson.loads(body)["turns"] if status == 200 else []
            continue
        batch = orjson.dumps({"replies": [{"turn_id": turn["id"], **REPLY} for turn in turns] or [NO_TURN]})
        status, body = await replies.send(request("POST", answer, HOST, batch))
        if status != 200:
            run.errors += len(turns)
        turns = pulled(body) if status == 200 and one_exchange else []
    pulls.close()
    replies.close()


def pulled(body: bytes) -> list[Any]:
    """The next batch a reply leased; a server that answered without one is not pulling (no silent plain pull)."""
    answered = orjson.loads(body)
    if "turns" not in answered:
        raise RuntimeError("POST /api/turns/replies?pull=N answered the replies but leased no batch")
    return list(answered["turns"])


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
    await running(serving, warmup_s)
    run.measuring = True
    if on_window:
        on_window(True)
    await running(serving, seconds)
    run.measuring = False
    if on_window:
        on_window(False)
    run.stop = True
    await asyncio.gather(*working)
    done.set()
    await serving
    return run


async def running(serving: asyncio.Task[None], seconds: float) -> None:
    """Let the load run for `seconds`; a trainer that stopped meanwhile ends the run at once, with its error (its
    agents would wait for it forever)."""
    await asyncio.wait({serving}, timeout=seconds)
    if serving.done():
        serving.result()
        raise RuntimeError("the trainer stopped while its agents were still calling")


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
