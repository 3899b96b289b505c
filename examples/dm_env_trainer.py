"""A training loop's shape over the dm_env view: episodes of the example task run side by side, each an agent
in its own sandbox, driven by reset/step with a scripted policy standing in for the model; rewards printed.

    python examples/dm_env_trainer.py [--episodes 8]      (needs Docker; builds the example images)

Swap `scripted_policy` for your model: it gets each observation (the agent's LLM request, in chat shape) and
returns the action (the assistant message). Episodes alternate between a script that fixes the bug and one
that does not, so the rewards come out 1 and 0.
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
from sandbox.agents.injection import InjectedAgent, inject
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.run.env import AgentEnv
from sandbox.run.runner import RunConfig
from sandbox.tasks.read import read_tasks
from sandbox.tasks.task import Task

EXAMPLE = Path(__file__).parent / "tasks" / "calc"
AGENT = Path(__file__).parent.parent / "agents" / "minimal"
IMAGES = [
    (AGENT, "trajproxy/agent-minimal"),
    (EXAMPLE, "trajproxy/example-calc"),
]  # the agent's first: the task's builds on it
SCRIPTS = [EXAMPLE / "solve.script.jsonl", EXAMPLE / "wrong.script.jsonl"]


def scripted_policy(script: list[dict[str, Any]], observation: dict[str, Any]) -> dict[str, Any]:
    """The n-th line of the script for the agent's n-th call (n counted from the assistant messages so far)."""
    replies = sum(1 for message in observation["messages"] if message.get("role") == "assistant")
    return script[min(replies, len(script) - 1)]


async def play(
    trainer: AsyncTrainerClient, sandboxes: DockerSandboxes, task: Task, agent: InjectedAgent, number: int
) -> str:
    script = [json.loads(line) for line in SCRIPTS[number % 2].read_text().splitlines() if line.strip()]
    async with AgentEnv(trainer, sandboxes, task, RunConfig(agent=agent)) as env:
        step = await env.reset()
        steps = 0
        while not step.last():
            assert step.observation is not None
            step = await env.step(scripted_policy(script, step.observation))
            steps += 1
        assert env.episode is not None
        return f"episode {number} ({env.episode.id}): {steps} steps, reward {step.reward:g}"


async def main(episodes: int, database_url: str) -> None:
    engine = docker.from_env()
    for path, tag in IMAGES:
        engine.images.build(path=str(path), tag=tag, rm=True)
    [task] = [task for task in read_tasks(EXAMPLE / "tasks.jsonl") if isinstance(task, Task)]
    agent = inject("minimal")  # its manifest (agents/minimal.toml) and its bundle, built once per machine
    async with embedded_proxy(database_url) as proxy, AsyncTrainerClient(proxy.url, proxy.token) as trainer:
        sandboxes = DockerSandboxes(proxy.socket_folder)
        for line in await asyncio.gather(*(play(trainer, sandboxes, task, agent, n) for n in range(episodes))):
            print(line, flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--database-url", help="where the episodes are recorded (default: a temporary SQLite file)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(main(args.episodes, args.database_url or f"sqlite:///{folder}/trajproxy.db"))
