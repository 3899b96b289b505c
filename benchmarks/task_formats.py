"""Task formats: what a Harbor task and a SWE-bench instance cost in sandboxes, step by step, as `trajproxy run`
runs them (Runner over DockerSandboxes, an embedded trajproxy, `--agent oracle` so no policy time is counted).

    python benchmarks/task_formats.py --repeats 5

For each task: its image built from the task's environment with nothing of it cached (a label unique to the run
makes the task's own layers new; the base image is local), the same build found in the cache (its content tag
already there), then each episode's steps from Outcome.timings: the sandbox started (agent and gate containers),
the solution run, the grade (Harbor's verifier in place; SWE-bench's eval script and report, fresh and in place),
and the whole episode. Medians over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import docker

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
from proxy.client import AsyncTrainerClient  # noqa: E402
from proxy.servers.embedded import embedded_proxy  # noqa: E402
from sandbox.backends.docker_sandboxes import DockerSandboxes  # noqa: E402
from sandbox.run.policies import TrainerPolicy  # noqa: E402
from sandbox.run.runner import RunConfig, Runner  # noqa: E402
from sandbox.tasks.formats import harbor  # noqa: E402
from sandbox.tasks.read import read_tasks  # noqa: E402
from sandbox.tasks.task import GradingMode, Task  # noqa: E402

HARBOR = ROOT / "examples" / "tasks" / "harbor"
SWEBENCH = ROOT / "examples" / "tasks" / "swebench"
SWE_IMAGES = "trajproxy-example/sweb.{instance_id}"
STEPS = ("start_s", "agent_s", "grade_s", "total_s")


def builds(client: Any, sandboxes: DockerSandboxes, name: str, scratch: Path) -> dict[str, float]:
    """Seconds to build the task's image with its own layers new, then to find it built."""
    folder = shutil.copytree(HARBOR / name, scratch / f"{name}-{time.time_ns()}")
    dockerfile = folder / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + f"LABEL trajproxy.bench.build={folder.name}\n")
    task = harbor.parse(folder)
    assert task.build is not None
    try:
        began = time.perf_counter()
        assert asyncio.run(sandboxes.build(task.build, task.image, 600)) is True
        cold = time.perf_counter() - began
        began = time.perf_counter()
        assert asyncio.run(sandboxes.build(task.build, task.image, 600)) is False
        cached = time.perf_counter() - began
    finally:
        client.images.remove(task.image, force=True)
    return {"build cold s": cold, "build cached ms": cached * 1000}


async def episodes(tasks: list[Task], grading: GradingMode | None, repeats: int) -> list[tuple[str, dict[str, float]]]:
    """Each task's id and timings, `repeats` times, one episode at a time."""
    timings: list[tuple[str, dict[str, float]]] = []
    async with embedded_proxy(f"sqlite:///{tempfile.mkdtemp()}/bench.db") as proxy:
        sandboxes = DockerSandboxes(proxy.socket_folder, labels={"trajproxy.bench": "task-formats"})
        async with AsyncTrainerClient(proxy.url, token=proxy.token) as trainer:
            runner = Runner(trainer, sandboxes, TrainerPolicy(), RunConfig(oracle=True, grading=grading))
            for _ in range(repeats):
                for task in tasks:
                    outcome = await runner.run(task)
                    assert outcome.reward == 1.0, outcome
                    timings.append((task.id, outcome.timings))
    return timings


def median(rows: list[tuple[str, dict[str, float]]], task: str, key: str) -> float:
    return statistics.median(timings[key] for name, timings in rows if name == task)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="episodes per task (and builds per Harbor task)")
    parser.add_argument("--quick", action="store_true", help="a smoke: once each")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    client = docker.from_env()
    for instance in ("calc__calc-1", "calc__calc-2"):
        client.images.build(
            path=str(SWEBENCH), tag=SWE_IMAGES.format(instance_id=instance), rm=True, buildargs={"INSTANCE": instance}
        )
    harbor_tasks = [task for task in read_tasks(HARBOR) if isinstance(task, Task)]
    swe = [
        task for task in read_tasks(SWEBENCH / "instances.jsonl", image_template=SWE_IMAGES) if isinstance(task, Task)
    ][:1]
    scratch = Path(tempfile.mkdtemp(prefix="trajproxy-bench-"))
    sandboxes = DockerSandboxes(str(scratch), labels={"trajproxy.bench": "task-formats"})
    built = {name: [builds(client, sandboxes, name, scratch) for _ in range(repeats)] for name in ("hello-world",)}
    runs = {
        "in-place (Harbor)": asyncio.run(episodes(harbor_tasks, None, repeats)),
        "fresh (SWE-bench)": asyncio.run(episodes(swe, None, repeats)),
        "in-place (SWE-bench)": asyncio.run(episodes(swe, "in-place", repeats)),
    }
    shutil.rmtree(scratch, ignore_errors=True)
    print("\n### Harbor task image builds\n")
    print("| task | build, changed task (s) | build found cached (ms) |\n|---|---:|---:|")
    for name, measured in built.items():
        cold = statistics.median(row["build cold s"] for row in measured)
        cached = statistics.median(row["build cached ms"] for row in measured)
        print(f"| {name} | {cold:.2f} | {cached:.1f} |")
    print("\n### One episode, step by step (oracle; seconds, medians)\n")
    print("| task | grading | sandbox start | solution | grade | episode |\n|---|---|---:|---:|---:|---:|")
    for grading, rows in runs.items():
        for task in dict.fromkeys(name for name, _ in rows):
            figures = " | ".join(f"{median(rows, task, key):.2f}" for key in STEPS)
            print(f"| {task} | {grading} | {figures} |", flush=True)


if __name__ == "__main__":
    main()
