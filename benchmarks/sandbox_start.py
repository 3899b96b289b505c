"""Sandbox: how long an episode takes to start, from its containers being created to its agent's process running
(its exec begun) and to its first LLM call parked at trajproxy. Episodes run as `trajproxy run` runs them (Runner
over DockerSandboxes, the example task), first one at a time, then many started at once, for each agent (the
minimal agent baked into the image, a stdlib one-call agent, and the native presets injected from their bundles)
and each size of the pool of gates started ahead (0: none, as before the pool).

    python benchmarks/sandbox_start.py --sequential 20 --at-once 32
    python benchmarks/sandbox_start.py --agents minimal,codex,claude-code --gate-pools 0,4 --sequential 10 --at-once 0

Each start is split into its steps, timed around the docker calls DockerSandboxes makes: the images checked,
the gate container created and started, the agent container created and started, the task uploaded, and the
agent's command run until its first call is parked (the turn's own created_at, on the same clock). The agent's
part is split further, once, in a separate sandbox: what a bare `docker exec` costs, a Python start-up, and
`import openai`. trajproxy runs pinned to core 0, this process (the runner and its trainer) on core 1; the
Docker engine and the containers run where the system puts them.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker

from proxy.client import AsyncTrainerClient, TrajproxyAPIError
from sandbox.agents.bundles import Bundles
from sandbox.agents.injection import InjectedAgent
from sandbox.agents.manifests import load
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.backends.interface import SandboxSpec
from sandbox.run.runner import Outcome, RunConfig, Runner
from sandbox.tasks.read import read_tasks
from sandbox.tasks.task import Task

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import cpu_seconds, percentile, pin_load, start_server  # noqa: E402
from sandbox_timing import Stopwatch, TimedSandboxes  # noqa: E402

ROOT = HERE.parent
EXAMPLE = ROOT / "examples" / "tasks" / "calc"
AGENT_IMAGE, TASK_IMAGE = "trajproxy/agent-minimal", "trajproxy/example-calc"
DONE = {"content": "```bash\necho TASK_COMPLETE\n```"}
STEPS = ("images", "gate", "agent box", "relay and upload", "agent to first call")
PRESETS = ("codex", "claude-code")  # injected from their bundles (built on first use)
# One chat call with the standard library, then exit: what a start costs without an agent SDK to load.
STDLIB_AGENT = """python3 -c 'import json, os, urllib.request
body = json.dumps({{"model": "m", "messages": [{{"role": "user", "content": open("{task_file}").read()}}]}})
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body.encode(),
    headers={{"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"}})
urllib.request.urlopen(request, timeout=300).read()'"""
BAKED_MINIMAL = "minimal-agent @{task_file} --workdir {workdir}"  # as its image (agents/minimal/Dockerfile) installs it
AGENT_COMMANDS = {"minimal": BAKED_MINIMAL, "stdlib": STDLIB_AGENT}


class FirstCalls:
    """A policy that notes when each episode's first call was parked and, once a whole wave's first calls
    are, tells every agent it is done."""

    def __init__(self) -> None:
        self.parked: dict[str, float] = {}
        self._wave = 0
        self._released = asyncio.Event()

    def new_wave(self, size: int) -> None:
        self._wave, self._released = len(self.parked) + size, asyncio.Event()

    async def serve(self, trainer: AsyncTrainerClient, episode_id: str) -> None:
        while True:
            for turn in await trainer.next_turns(episode=episode_id, max=8, wait_s=10):
                if episode_id not in self.parked:
                    self.parked[episode_id] = turn.created_at
                    if len(self.parked) >= self._wave:
                        self._released.set()
                    await self._released.wait()
                try:
                    await trainer.reply(turn.id, message=DONE, lease_id=turn.lease_id)
                except TrajproxyAPIError as e:
                    if e.status != 409:
                        raise


def machine_busy() -> tuple[float, float]:
    """Busy and total CPU time of the whole machine so far (all cores, in clock ticks)."""
    ticks = [int(n) for n in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return sum(ticks) - idle, sum(ticks)


def steps(marks: dict[str, float], parked: float) -> dict[str, float]:
    """One episode's start, step by step (seconds), and in all: to its agent's process running (its exec begun) and
    to its first call parked. A gate taken from the pool was made before the start: its steps are 0, and "images"
    then includes any wait for a pooled gate still being started (many starts at once)."""
    gate_made = marks.get("gate create", marks["agent create"])
    gate_started = marks.get("gate started", gate_made)
    return {
        "images": gate_made - marks["start"],
        "gate": gate_started - gate_made,
        "agent box": marks["agent started"] - gate_started,
        "relay and upload": marks["exec"] - marks["agent started"],
        "agent to first call": parked - marks["exec"],
        "running": marks["exec"] - marks["start"],
        "total": parked - marks["start"],
    }


def run_config(agent: str) -> RunConfig:
    """How the episodes run `agent`: a command in the example's image, or a preset injected from its bundle."""
    if agent in PRESETS:
        manifest = load(agent)
        return RunConfig(
            agent=InjectedAgent(manifest, Bundles().ensure(manifest)), agent_timeout_s=300, grade_timeout_s=120
        )
    return RunConfig(agent_cmd=AGENT_COMMANDS[agent], agent_timeout_s=300, grade_timeout_s=120)


async def episodes(
    url: str, socket_folder: str, task: Task, client: Any, counts: tuple[int, int], threads: int, agent: str, pool: int
) -> dict[str, Any]:
    sequential, at_once = counts
    if threads:  # each running agent holds a worker thread (its docker exec) for its whole run
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=threads))
    watch, policy = Stopwatch(), FirstCalls()
    label = secrets.token_hex(6)
    sandboxes = TimedSandboxes(socket_folder, watch, client, label, pool)
    config = run_config(agent)
    await sandboxes.warm()  # as `trajproxy run` does while it sets up
    try:
        async with AsyncTrainerClient(url) as trainer:
            runner = Runner(trainer, sandboxes, policy, config)
            one_by_one = []
            for _ in range(sequential):
                policy.new_wave(1)
                one_by_one.append(await runner.run(task))
            policy.new_wave(at_once if threads else 1)  # too few threads to hold a whole wave: answer at once
            launched = time.time()
            together = await runner.run_many([task] * at_once, concurrency=at_once)
            agent_parts = await agent_start_up(sandboxes, task) if agent == "minimal" else {}
    finally:
        await sandboxes.close()
        await sandboxes.prune()
    parked = [policy.parked[str(outcome.episode_id)] for outcome in together if outcome.episode_id in policy.parked]
    return {
        "sequential": starts(one_by_one, watch, policy),
        "at_once": starts(together, watch, policy),
        "all_parked_s": max(parked) - launched if parked and len(parked) == at_once else math.nan,
        "agent_parts": agent_parts,
        "failed": [f"{o.status}: {o.reason}" for o in [*one_by_one, *together] if o.status != "finished"],
    }


def starts(outcomes: list[Outcome], watch: Stopwatch, policy: FirstCalls) -> list[dict[str, float]]:
    """The step-by-step start of each episode whose agent's first call was parked."""
    ids = [str(outcome.episode_id) for outcome in outcomes if outcome.episode_id in policy.parked]
    return [steps(watch.marks[episode], policy.parked[episode]) for episode in ids]


async def agent_start_up(sandboxes: DockerSandboxes, task: Task, times: int = 5) -> dict[str, float]:
    """The agent's start-up, in parts (medians, s): a bare docker exec, a Python start-up, `import openai`, and
    the SDK's client made and its chat resource loaded (imported lazily, on the first call)."""
    box = await sandboxes.start(SandboxSpec(task.image, workdir=task.workdir, proxy=False))
    commands = {
        "docker exec": "true",
        "python start": "python3 -c pass",
        "import openai": "python3 -c 'import openai'",
        "openai client": "python3 -c 'import openai; openai.OpenAI(api_key=\"-\").chat.completions.create'",
    }
    try:
        took: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(times):
            for name, command in commands.items():
                started = time.perf_counter()
                result = await box.exec(command, timeout_s=60)
                if not result.ok:
                    raise RuntimeError(f"{command!r} failed in the sandbox: {result.output}")
                took[name].append(time.perf_counter() - started)
    finally:
        await box.stop()
    medians = [statistics.median(took[name]) for name in commands]
    return {name: median - before for name, median, before in zip(commands, medians, [0.0, *medians], strict=False)}


def ensure_images(client: Any) -> None:
    """The example task's image, built from the repository's Dockerfiles if it is missing (as the tests do)."""
    try:
        client.images.get(TASK_IMAGE)
    except docker.errors.ImageNotFound:
        client.images.build(path=str(ROOT / "agents" / "minimal"), tag=AGENT_IMAGE, rm=True)
        client.images.build(path=str(EXAMPLE), tag=TASK_IMAGE, rm=True)


def bench(
    sequential: int, at_once: int, port: int, threads: int = 64, agent: str = "minimal", pool: int = 0
) -> dict[str, Any]:
    client = docker.from_env(max_pool_size=max(threads, 10))
    ensure_images(client)
    [task] = [task for task in read_tasks(EXAMPLE / "tasks.jsonl") if isinstance(task, Task)]
    folder = tempfile.mkdtemp(prefix="tp")  # short: Unix socket paths are limited to 108 bytes
    try:
        with tempfile.TemporaryDirectory() as data:
            flags = ["--socket-path", f"{folder}/proxy.sock"]
            server = start_server(port, f"sqlite:///{data}/bench.db", flags=flags)
            try:
                server_cpu, load_cpu, wall = cpu_seconds(server.pid), time.process_time(), time.perf_counter()
                busy, total = machine_busy()
                url = f"http://127.0.0.1:{port}"
                counts = (sequential, at_once)
                result = asyncio.run(episodes(url, folder, task, client, counts, threads, agent, pool))
                wall = time.perf_counter() - wall
                result["server_cpu"] = (cpu_seconds(server.pid) - server_cpu) / wall
                result["load_cpu"] = (time.process_time() - load_cpu) / wall
                now_busy, now_total = machine_busy()
                result["machine_cpu"] = (now_busy - busy) / (now_total - total)  # of all cores
            finally:
                server.send_signal(signal.SIGINT)
                server.wait(30)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        client.close()
    return result


def summary(result: dict[str, Any]) -> dict[str, float]:
    """The headline figures of a run (seconds)."""
    sequential = [start["total"] for start in result["sequential"]] or [math.nan]
    together = [start["total"] for start in result["at_once"]] or [math.nan]
    running = [start["running"] for start in result["sequential"]] or [math.nan]
    figures = {
        "p50_s": percentile(sequential, 50),
        "p95_s": percentile(sequential, 95),
        "running_p50_s": percentile(running, 50),
        "running_p95_s": percentile(running, 95),
        "at_once_all_parked_s": result["all_parked_s"],
        "at_once_p50_s": percentile(together, 50),
        "at_once_max_s": max(together),
        "failed": len(result["failed"]),
        "server_cpu": result["server_cpu"],
        "load_cpu": result["load_cpu"],
        "machine_cpu": result["machine_cpu"],
    }
    for step in STEPS:
        figures[f"{step} s"] = statistics.median([start[step] for start in result["sequential"]] or [math.nan])
        figures[f"{step} share"] = figures[f"{step} s"] / figures["p50_s"]
    figures.update({f"{part} s": took for part, took in result["agent_parts"].items()})
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--sequential", type=int, default=20, help="episodes started one after another")
    parser.add_argument("--at-once", type=int, default=32, help="episodes then started all at once")
    parser.add_argument(
        "--threads",
        type=int,
        default=64,
        help="worker threads for the docker calls (each running agent holds one); 0: asyncio's default",
    )
    parser.add_argument(
        "--agents",
        default="minimal",
        help="comma-separated: minimal (baked into the image, openai SDK), stdlib (one call with urllib, no SDK), "
        f"and the presets injected from their bundles ({', '.join(PRESETS)})",
    )
    parser.add_argument("--gate-pools", default="0", help="comma-separated sizes of the pool of ready gates (0: none)")
    parser.add_argument("--port", type=int, default=18800)
    parser.add_argument("--quick", action="store_true", help="a short smoke: 3 one by one, then 4 at once")
    args = parser.parse_args()
    if args.quick:
        args.sequential, args.at_once = 3, 4
    pin_load()
    failed = []
    table = []
    for agent in args.agents.split(","):
        for pool in [int(size) for size in args.gate_pools.split(",")]:
            print(f"== {agent}, gate pool {pool}", flush=True)
            result = bench(args.sequential, args.at_once, args.port, args.threads, agent, pool)
            report(args, result)
            failed += result["failed"]
            table.append((agent, pool, summary(result)))
    print(
        "\n| agent | gate pool | to running p50 s | p95 s | to first call p50 s | p95 s | " + " | ".join(STEPS) + " |"
    )
    print("|---|---:|---:|---:|---:|---:|" + "---:|" * len(STEPS))
    for agent, pool, figures in table:
        shares = " | ".join(f"{figures[f'{step} s']:.3f} ({figures[f'{step} share']:.0%})" for step in STEPS)
        print(
            f"| {agent} | {pool} | {figures['running_p50_s']:.2f} | {figures['running_p95_s']:.2f} | "
            f"{figures['p50_s']:.2f} | {figures['p95_s']:.2f} | {shares} |"
        )
    sys.exit(1 if failed else 0)


def report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    figures = summary(result)
    print(
        f"one at a time ({args.sequential}): to running p50 {figures['running_p50_s']:.2f} s, "
        f"p95 {figures['running_p95_s']:.2f} s; to first call p50 {figures['p50_s']:.2f} s, "
        f"p95 {figures['p95_s']:.2f} s"
    )
    print("  median of each step: " + ", ".join(f"{step} {figures[f'{step} s']:.3f} s" for step in STEPS))
    parts = result["agent_parts"]
    print("  the agent's start-up, measured apart: " + ", ".join(f"{p} {s:.3f} s" for p, s in parts.items()))
    if result["at_once"]:
        together = result["at_once"]
        print(f"{args.at_once} at once: all first calls parked after {figures['at_once_all_parked_s']:.2f} s")
        print("  each one's start (s): " + " ".join(f"{start['total']:.2f}" for start in together))
        medians = {step: statistics.median(start[step] for start in together) for step in STEPS}
        print("  median of each step: " + ", ".join(f"{step} {took:.3f} s" for step, took in medians.items()))
    print(
        f"server cpu {figures['server_cpu']:.0%}, load cpu {figures['load_cpu']:.0%}, "
        f"whole machine {figures['machine_cpu']:.0%} of {os.cpu_count()} cores"
    )
    for failure in result["failed"]:
        print(f"  failed: {failure}")


if __name__ == "__main__":
    main()
