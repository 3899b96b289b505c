"""The batch loop: many sandboxed agents at once; the trainer pulls up to N parked calls across all episodes,
answers them with one model batch, and replies to all of them in one call.

    python examples/batch_trainer.py [--episodes 8] [--batch 64]      (needs Docker; builds the example images)

`model_batch` stands in for your policy's batched generation: it takes the observations (the agents' requests,
in chat shape) and returns one action (an assistant message) for each. Here it follows the script that fixes
the example bug, so every episode earns 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import docker

from proxy.client import AsyncTrainerClient
from proxy.servers.embedded import embedded_proxy
from sandbox.agents.injection import inject
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.run.policies import TrainerPolicy
from sandbox.run.runner import RunConfig, Runner
from sandbox.tasks.read import read_tasks
from sandbox.tasks.task import Task

EXAMPLE = Path(__file__).parent / "tasks" / "calc"
AGENT = Path(__file__).parent.parent / "agents" / "minimal"
IMAGES = [(AGENT, "trajproxy/agent-minimal"), (EXAMPLE, "trajproxy/example-calc")]  # the task builds on the agent
SCRIPT = [json.loads(line) for line in (EXAMPLE / "solve.script.jsonl").read_text().splitlines() if line.strip()]


def model_batch(observations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One action per observation: the script's line for how far the agent's conversation has got."""
    actions = []
    for observation in observations:
        replies = sum(1 for message in observation["messages"] if message.get("role") == "assistant")
        actions.append(SCRIPT[min(replies, len(SCRIPT) - 1)])
    return actions


async def main(episodes: int, batch: int, linger_s: float, database_url: str) -> None:
    engine = docker.from_env()
    for path, tag in IMAGES:
        engine.images.build(path=str(path), tag=tag, rm=True)
    [task] = [task for task in read_tasks(EXAMPLE / "tasks.jsonl") if isinstance(task, Task)]
    async with embedded_proxy(database_url) as proxy, AsyncTrainerClient(proxy.url, proxy.token) as trainer:
        config = RunConfig(agent=inject("minimal"))  # its bundle built once per machine
        runner = Runner(trainer, DockerSandboxes(proxy.socket_folder), TrainerPolicy(), config)
        run = asyncio.create_task(runner.run_many([task] * episodes, concurrency=episodes))
        while not run.done():
            turns = await trainer.next_turns(max=batch, wait_s=1.0)
            if not turns:
                continue
            if len(turns) < batch:  # let the batch fill a little: other agents' calls are on their way
                await asyncio.sleep(linger_s)
                turns += await trainer.next_turns(max=batch - len(turns))
            actions = model_batch([turn.request for turn in turns])
            results = await trainer.reply_many(
                [{"turn_id": t.id, "lease_id": t.lease_id, "message": a} for t, a in zip(turns, actions, strict=True)]
            )
            refused = [result for result in results if result.status != 200]
            print(f"batch of {len(turns)} turn(s) answered, {len(refused)} refused", flush=True)
        for outcome in run.result():
            print(f"episode {outcome.episode_id}: {outcome.status}, reward {outcome.reward}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="the most turns pulled (and answered) at once")
    parser.add_argument("--linger-s", type=float, default=0.2, help="how long a batch waits to fill up")
    parser.add_argument("--database-url", help="where the episodes are recorded (default: a temporary SQLite file)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(
            main(args.episodes, args.batch, args.linger_s, args.database_url or f"sqlite:///{folder}/trajproxy.db")
        )
