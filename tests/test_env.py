"""The dm_env view in Python: AgentEnv over a real sandboxed agent, and the example trainer that drives eight
of them side by side."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from typing import Any

import pytest

from proxy.client import AsyncTrainerClient, TrainerClient
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.run.env import AgentEnv
from sandbox.run.runner import RunConfig
from sandbox.tasks.task import Task
from testkit.tasks import BAKED_MINIMAL, ROOT
from tests.conftest import mine

FIX = {"content": "```bash\nsed -i 's/return a - b/return a + b/' calc.py\n```"}
DONE = {"content": "```bash\necho TASK_COMPLETE\n```"}


@pytest.fixture
def database_url(tmp_path: Any) -> str:
    return f"sqlite:///{tmp_path}/trajproxy.db"


def test_an_env_walks_an_agent_from_its_first_request_to_its_grade(
    proxied: Any, sandboxes: DockerSandboxes, example_task: Task
) -> None:
    async def main() -> tuple[list[Any], Any]:
        async with AsyncTrainerClient(proxied.url, proxied.token) as trainer:
            async with AgentEnv(trainer, sandboxes, example_task, RunConfig(agent_cmd=BAKED_MINIMAL)) as env:
                steps = [await env.reset()]
                for action in (FIX, DONE):
                    steps.append(await env.step(action))
            return steps, env

    steps, env = asyncio.run(main())
    assert [step.step_type for step in steps] == [0, 1, 2]
    first, mid, last = steps
    assert first.observation is not None and "calc.py" in first.observation["messages"][-1]["content"]
    assert mid.observation is not None and mid.observation["messages"][-2]["content"] == FIX["content"]
    assert (last.reward, last.discount, last.episode.status) == (1.0, 0.0, "finished")
    assert env.outcome is not None and env.outcome.reward == 1.0 and "a + b" in env.outcome.diff
    with TrainerClient(proxied.url, proxied.token) as trainer:
        turns = trainer.trajectory(env.episode.id).turns
    assert [t.reply.message["content"] if t.reply and t.reply.message else None for t in turns] == [
        FIX["content"],
        DONE["content"],
    ]


def test_leaving_before_the_end_cancels_the_episode_and_its_sandbox(
    proxied: Any, sandboxes: DockerSandboxes, example_task: Task, engine: Any
) -> None:
    async def main() -> Any:
        async with AsyncTrainerClient(proxied.url, proxied.token) as trainer:
            async with AgentEnv(trainer, sandboxes, example_task, RunConfig(agent_cmd=BAKED_MINIMAL)) as env:
                await env.reset()
            return env

    env = asyncio.run(main())
    assert env.outcome is None
    with TrainerClient(proxied.url, proxied.token) as trainer:
        episode = trainer.episode(env.episode.id)
    assert (episode.status, episode.reason) == ("cancelled", "the run was interrupted")
    assert engine.containers.list(all=True, filters={"label": mine(sandboxes)}) == []


def test_an_env_must_be_entered_before_use(proxied: Any, sandboxes: DockerSandboxes, example_task: Task) -> None:
    async def main() -> None:
        async with AsyncTrainerClient(proxied.url, proxied.token) as trainer:
            await AgentEnv(trainer, sandboxes, example_task, RunConfig(agent_cmd="true")).reset()

    with pytest.raises(RuntimeError, match="async with AgentEnv"):
        asyncio.run(main())


def run_example(script: str, *args: str) -> str:
    """Run an example as a user would; returns what it printed."""
    done = subprocess.run(
        [sys.executable, f"examples/{script}", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_example_trainer_runs_eight_episodes_and_prints_their_rewards(engine: Any) -> None:
    printed = run_example("dm_env_trainer.py", "--episodes", "8")
    lines = re.findall(r"^episode (\d) \(ep_\w+\): (\d) steps, reward (\S+)$", printed, re.MULTILINE)
    assert lines == [(str(n), "3" if n % 2 == 0 else "2", "1" if n % 2 == 0 else "0") for n in range(8)], printed


def test_the_batch_trainer_answers_many_agents_in_batches(engine: Any) -> None:
    printed = run_example("batch_trainer.py", "--episodes", "4")
    batches = [int(n) for n, refused in re.findall(r"^batch of (\d+) turn\(s\) answered, (\d+) refused$",
                                                    printed, re.MULTILINE) if refused == "0"]  # fmt: skip
    assert sum(batches) == 4 * 3, printed  # each agent makes three calls to solve the task
    endings = re.findall(r"^episode ep_\w+: (\w+), reward (\S+)$", printed, re.MULTILINE)
    assert endings == [("finished", "1.0")] * 4, printed
