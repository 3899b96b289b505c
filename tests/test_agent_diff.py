"""The agent's diff, from the sandbox to the page: the runner records it with the grader's reward, and the episode
page shows it as a diff, its added and removed lines marked for colour."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx

from proxy.client import AsyncTrainerClient, TrainerClient
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.run.policies import ScriptedPolicy
from sandbox.run.runner import RunConfig, Runner
from sandbox.tasks.task import Task
from testkit.tasks import BAKED_MINIMAL, EXAMPLE


def test_the_runner_records_the_agents_diff_and_the_page_colours_it(
    proxied: Any, sandboxes: DockerSandboxes, example_task: Task
) -> None:
    async def main() -> Any:
        async with AsyncTrainerClient(proxied.url, proxied.token) as trainer:
            policy = ScriptedPolicy(EXAMPLE / "solve.script.jsonl")
            runner = Runner(trainer, sandboxes, policy, RunConfig(agent_cmd=BAKED_MINIMAL))
            return await runner.run(example_task)

    outcome = asyncio.run(main())
    assert outcome.status == "finished" and "return a + b" in outcome.diff, outcome.reason
    with TrainerClient(proxied.url, proxied.token) as trainer:
        [reward] = trainer.trajectory(outcome.episode_id).rewards
    assert reward.info["diff"] == outcome.diff

    headers = {"authorization": f"Bearer {proxied.token}"}
    page = httpx.get(f"{proxied.url}/ui/episodes/{outcome.episode_id}", headers=headers, timeout=30).text
    shown = page[page.index('id="diff"') :]
    assert re.search(r'<span class="d-add">\+\s+return a \+ b</span>', shown), shown[:2000]
    assert re.search(r'<span class="d-del">-\s+return a - b</span>', shown), shown[:2000]
    assert re.search(r'<span class="d-file">\+\+\+ b/calc.py</span>', shown), shown[:2000]
