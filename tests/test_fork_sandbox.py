"""Forks of sandboxed agents: a recorded episode of the minimal agent, and of mini-swe-agent (a real CLI), forked
at the first call, the second and the last, three times each: every fork runs its agent afresh in a new sandbox,
its first k calls are answered from the recording, the policy sees only the calls after k, and each fork is graded
and rewarded on its own. A task changed since the recording stops the replay at once, and the fork says why.
The forks allow what a real run varies in (a test run's timing, a few characters of thousands) with a similarity
bound; the changed task is matched exactly."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from proxy.client import AsyncTrainerClient, TrainerClient
from sandbox.agents.bundles import Bundles
from sandbox.agents.injection import InjectedAgent
from sandbox.agents.manifests import load
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.run.policies import ScriptedPolicy
from sandbox.run.runner import Outcome, RunConfig, Runner
from sandbox.tasks.task import Task
from testkit.tasks import EXAMPLE

SCRIPTS = {"minimal": "solve.script.jsonl", "mini-swe-agent": "solve.mini-swe-agent.script.jsonl"}


@pytest.fixture
def database_url(tmp_path: Any) -> str:
    return f"sqlite:///{tmp_path}/trajproxy.db"


def steady(request: Any) -> Any:
    """A request with its tool outputs' test timings ("Ran 2 tests in 0.008s") blanked: what the forks allow for."""
    return json.loads(re.sub(r"in \d+\.\d+s", "in <time>s", json.dumps(request)))


def runner_for(trainer: AsyncTrainerClient, sandboxes: DockerSandboxes, name: str) -> Runner:
    manifest = load(name)
    agent = InjectedAgent(manifest, Bundles().ensure(manifest), None)
    return Runner(trainer, sandboxes, ScriptedPolicy(EXAMPLE / SCRIPTS[name]), RunConfig(agent=agent))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_forks_of_a_sandboxed_agent_replay_its_first_calls(
    proxied: Any, proxied_trainer: TrainerClient, sandboxes: DockerSandboxes, example_task: Task, name: str
) -> None:
    async def main() -> tuple[Outcome, dict[int, list[Outcome]], Outcome]:
        async with AsyncTrainerClient(proxied.url, proxied.token) as trainer:
            runner = runner_for(trainer, sandboxes, name)
            [parent] = await runner.run_many([example_task], 1)
            assert parent.episode_id is not None
            calls = len((await trainer.trajectory(parent.episode_id)).turns)
            forks = {}
            for at in sorted({0, 1, calls}):
                # A test's own timing ("Ran 1 test in 0.001s") differs from run to run: a few characters of many.
                made = await trainer.fork(parent.episode_id, at, 3, min_similarity=0.99)
                forks[at] = await runner.run_many([example_task] * 3, 3, made)
            changed = replace(example_task, prompt=example_task.prompt + " Say what you changed.")
            [perturbed] = await runner.run_many([changed], 1, await trainer.fork(parent.episode_id, calls))
            return parent, forks, perturbed

    parent, forks, perturbed = asyncio.run(main())
    assert (parent.status, parent.reward) == ("finished", 1.0), parent
    trainer = proxied_trainer
    assert parent.episode_id is not None
    recorded = trainer.trajectory(parent.episode_id).turns
    for at, outcomes in forks.items():
        for outcome in outcomes:
            assert (outcome.status, outcome.reward) == ("finished", 1.0), (at, outcome)
            assert outcome.episode_id is not None
            trajectory = trainer.trajectory(outcome.episode_id)
            answered_by = [turn.reply.answered_by for turn in trajectory.turns if turn.reply]
            assert answered_by[:at] == ["replay"] * at, (at, answered_by)
            assert all(who != "replay" for who in answered_by[at:]), (at, answered_by)
            replayed, parents = trajectory.turns[:at], recorded[:at]
            assert [steady(turn.request) for turn in replayed] == [steady(turn.request) for turn in parents]
            assert [t.reply.message if t.reply else None for t in replayed] == [
                t.reply.message if t.reply else None for t in parents
            ]
            assert [reward.source for reward in trajectory.rewards] == ["grader"]
            assert "diverged" not in trainer.episode(outcome.episode_id).metadata["fork"]
    assert perturbed.episode_id is not None
    fork = trainer.episode(perturbed.episode_id).metadata["fork"]
    assert fork["diverged"]["seq"] == 0 and "differs from episode" in fork["diverged"]["why"], fork
    turns = trainer.trajectory(perturbed.episode_id).turns
    assert all(turn.reply is None or turn.reply.answered_by != "replay" for turn in turns)


def test_trajproxy_run_forks_a_recorded_episode(engine: Any, task_image: str, tmp_path: Path, label: str) -> None:
    database = tmp_path / "run.db"
    tasks = str(EXAMPLE / "tasks.jsonl")
    script = f"scripted:{EXAMPLE / 'solve.script.jsonl'}"
    run = [str(Path(sys.executable).parent / "trajproxy"), "run", tasks, "--agent", "minimal", "--policy", script]
    options = ["--port", "0", "--database-url", f"sqlite:///{database}", "--label", label]
    done = subprocess.run([*run, *options], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(database) as db:
        [(parent,)] = db.execute("SELECT id FROM episode").fetchall()

    done = subprocess.run([*run, *options, "--fork", f"{parent}@1", "-n", "2"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "2 task(s) run, 0 rejected, mean reward 1.000" in done.stderr
    with sqlite3.connect(database) as db:
        forks = db.execute("SELECT id FROM episode WHERE id != ? AND status = 'finished'", (parent,)).fetchall()
        replayed = db.execute("SELECT count(*) FROM turn WHERE answered_by = 'replay'").fetchone()
    assert len(forks) == 2 and replayed == (2,)  # each fork's first call
    assert not engine.containers.list(all=True, filters={"label": label})

    for spec, said in ((f"{parent}@x", "expected EPISODE@K"), ("ep_nope@1", "cannot fork ep_nope@1")):
        refused = subprocess.run([*run, *options, "--fork", spec], capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and said in refused.stderr, refused.stderr
