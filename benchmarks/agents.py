"""Agents injected from bundles, for every preset in agents/: its bundle's size and how long it took to build (as
recorded when this machine built it, in the bundles folder; --cold builds each again in a new folder, with npm's and
pip's download caches as they are), and how long an episode takes to start, from its sandbox's containers being
created to the agent's first LLM call parked at trajproxy, injected into a task image with no Python and no Node,
against the minimal agent baked into its image (the example task).

    python benchmarks/agents.py --episodes 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import docker

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from proxy.client import AsyncTrainerClient, TrajproxyAPIError  # noqa: E402
from proxy.servers.embedded import embedded_proxy  # noqa: E402
from sandbox.agents.bundles import Bundles  # noqa: E402
from sandbox.agents.injection import InjectedAgent  # noqa: E402
from sandbox.agents.manifests import load, presets  # noqa: E402
from sandbox.backends.docker_sandboxes import DockerSandbox, DockerSandboxes  # noqa: E402
from sandbox.backends.interface import SandboxSpec  # noqa: E402
from sandbox.run.runner import RunConfig, Runner  # noqa: E402
from sandbox.tasks.formats.jsonl import ExitCode  # noqa: E402
from sandbox.tasks.task import Task  # noqa: E402
from testkit.presets import BARE, BARE_DOCKERFILE, PRESETS, TASK, text_commands  # noqa: E402
from testkit.tasks import BAKED_MINIMAL  # noqa: E402

sys.path.insert(0, str(HERE))
from harness import percentile  # noqa: E402

BAKED_IMAGE = "trajproxy/example-calc"


class TimedSandboxes(DockerSandboxes):
    """Notes when each episode's sandbox start began (before its first container is created)."""

    started: dict[str, float]

    async def start(self, spec: SandboxSpec) -> DockerSandbox:
        if spec.proxy:
            self.started[spec.labels["trajproxy.episode"]] = time.time()
        return await super().start(spec)


class FirstCall:
    """Answers as the preset's scripted policy does, noting when each episode's first call was parked."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.parked: dict[str, float] = {}

    async def serve(self, trainer: AsyncTrainerClient, episode_id: str) -> None:
        while True:
            for turn in await trainer.next_turns(episode=episode_id, max=8, wait_s=10):
                self.parked.setdefault(episode_id, turn.created_at)
                try:
                    await trainer.reply(turn.id, message=self.answer(turn), lease_id=turn.lease_id)
                except TrajproxyAPIError as e:
                    if e.status != 409:
                        raise


def builds(names: list[str], cold: bool) -> dict[str, dict[str, float]]:
    """Each preset's bundle: its size, and its build time as recorded (or, `cold`, measured again here)."""
    times = {}
    with tempfile.TemporaryDirectory(prefix="trajproxy-bench-bundles-") as root:
        bundles = Bundles(Path(root)) if cold else Bundles()
        for name in names:
            bundle = bundles.ensure(load(name))
            started = time.monotonic()
            assert bundles.ensure(load(name)) == bundle
            cached = time.monotonic() - started
            times[name] = {"build_s": bundle.built_s, "found_s": cached, "size_mb": bundle.size_bytes / 1e6}
            print(f"bundle {name}: {times[name]}", flush=True)
    return times


async def starts(config: RunConfig, task: Task, answer: Any, episodes: int, socket: str, url: str, token: Any) -> Any:
    sandboxes = TimedSandboxes(socket, labels={"trajproxy.bench": secrets.token_hex(6)})
    sandboxes.started = {}
    policy = FirstCall(answer)
    try:
        async with AsyncTrainerClient(url, token=token) as trainer:
            runner = Runner(trainer, sandboxes, policy, config)
            outcomes = [await runner.run(task) for _ in range(episodes)]
    finally:
        await sandboxes.prune()
    seconds = [policy.parked[e] - sandboxes.started[e] for e in policy.parked if e in sandboxes.started]
    failed = [o.reason for o in outcomes if o.status != "finished"]
    return {"p50_s": percentile(seconds, 50), "p95_s": percentile(seconds, 95), "n": len(seconds), "failed": failed}


async def start_times(names: list[str], episodes: int) -> dict[str, Any]:
    client = docker.from_env()
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "Dockerfile").write_text(BARE_DOCKERFILE)
        client.images.build(path=folder, tag=BARE, rm=True)
    bundles = Bundles()
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        async with embedded_proxy(f"sqlite:///{folder}/bench.db") as proxy:
            args = (episodes, proxy.socket_folder, proxy.url, proxy.token)
            baked = Task(TASK, BAKED_IMAGE, "/repo", ExitCode("true"))
            results["minimal (baked)"] = await starts(RunConfig(BAKED_MINIMAL), baked, text_commands, *args)
            print(f"start minimal (baked): {results['minimal (baked)']}", flush=True)
            for name in names:
                _, answer = PRESETS.get(name, ("", text_commands))  # its own tool format, where the tests have one
                agent = InjectedAgent(load(name), bundles.ensure(load(name)))
                task = Task(TASK, BARE, "/repo", ExitCode("sh test.sh"))
                results[name] = await starts(RunConfig(agent=agent), task, answer, *args)
                print(f"start {name}: {results[name]}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=10, help="episodes started per agent, one at a time")
    parser.add_argument("--cold", action="store_true", help="build each bundle again, in a new folder")
    parser.add_argument("agents", nargs="*", help="presets to measure (default: every preset)")
    args = parser.parse_args()
    names = args.agents or presets()
    result = {"bundles": builds(names, args.cold), "starts": asyncio.run(start_times(names, args.episodes))}
    print(json.dumps(result, indent=2))
    print("\n| agent | bundle | built in | start p50 | start p95 | failed |\n|---|---|---|---|---|---|")
    for name, start in result["starts"].items():
        bundle = result["bundles"].get(name)
        built = f"{bundle['size_mb']:.0f} MB | {bundle['build_s']:.0f} s" if bundle else "baked into the image | -"
        failed = len(start["failed"])
        print(f"| `{name}` | {built} | {start['p50_s']:.2f} s | {start['p95_s']:.2f} s | {failed} of {args.episodes} |")


if __name__ == "__main__":
    main()
