"""The runner on a second backend: local sandboxes (tests/local_sandboxes.py, no Docker) behind the same Sandboxes
interface, driving the real Runner and AgentEnv against a live trajproxy, the minimal agent answered by a scripted
policy and graded by the task's own check. What it proves is the runner's own logic, in seconds: episodes, turns,
rewards, diffs, builds, fresh grading, and each way an episode fails."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from proxy.cli.main import main
from proxy.client import AsyncTrainerClient, TrainerClient
from proxy.storage.samples import infrastructure_failure
from sandbox.run.env import AgentEnv
from sandbox.run.policies import ScriptedPolicy
from sandbox.run.runner import Outcome, RunConfig, Runner
from sandbox.tasks.formats.jsonl import ExitCode
from sandbox.tasks.read import read_tasks
from sandbox.tasks.task import Task
from testkit.tasks import EXAMPLE, ROOT
from tests.conftest import LiveServer
from tests.local_sandboxes import LocalSandboxes
from tests.test_runner import assert_fixed_and_graded

IMAGE = "calc"
# The minimal agent, run by the Python running the tests (which has the openai SDK): an --agent-cmd.
AGENT_CMD = f"{sys.executable} {ROOT / 'agents' / 'minimal' / 'agent.py'} @{{task_file}} --workdir {{workdir}}"

pytestmark = pytest.mark.skipif(
    subprocess.run(["unshare", "--map-root-user", "--mount", "true"], capture_output=True).returncode != 0,
    reason="local sandboxes need unshare (a private mount namespace) on this machine",
)


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/trajproxy.db"


@pytest.fixture
def image(tmp_path: Path) -> Path:
    """The example task's repository, committed, as its Dockerfile makes it."""
    repo = tmp_path / "image"
    shutil.copytree(EXAMPLE / "repo", repo)
    git = ["git", "-c", "user.email=task@example.com", "-c", "user.name=task"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "task: a calculator whose add is wrong"]):
        subprocess.run([*git, *command], cwd=repo, check=True)
    return repo


@pytest.fixture
def proxy(make_server: Any) -> LiveServer:
    served: LiveServer = make_server()
    return served


@pytest.fixture
def sandboxes(proxy: LiveServer, image: Path, tmp_path: Path) -> Iterator[LocalSandboxes]:
    boxes = tmp_path / "boxes"
    boxes.mkdir()
    before = children()
    yield LocalSandboxes(proxy.url, boxes, {IMAGE: image}, path=Path(sys.executable).parent)
    assert not list(boxes.iterdir()), "a sandbox was left behind"
    # and no process: an episode that ends by its deadline has its sandbox's commands killed and reaped
    assert children() - before == set(), "a sandbox's process outlived its episode"


def children() -> set[str]:
    """This process's child processes (zombies too: one not reaped yet is still left), each as `pid command`."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
        except OSError:  # it has exited since
            continue
        command, fields = rest.rsplit(") ", 1)
        if int(fields.split()[1]) == os.getpid():
            found.add(f"{pid} {command}")
    return found


@pytest.fixture
def task() -> Task:
    [read] = list(read_tasks(EXAMPLE / "tasks.jsonl"))
    assert isinstance(read, Task)
    return replace(read, image=IMAGE, workdir=None)  # a local sandbox works in its own folder


async def run_tasks(
    proxy: LiveServer, sandboxes: LocalSandboxes, tasks: list[Task], script: str, concurrency: int = 1, **config: Any
) -> list[Outcome]:
    async with AsyncTrainerClient(proxy.url, proxy.token) as trainer:
        config.setdefault("agent_cmd", AGENT_CMD)
        runner = Runner(trainer, sandboxes, ScriptedPolicy(EXAMPLE / script), RunConfig(**config))
        return await runner.run_many(tasks, concurrency=concurrency)


def at_once(*runs: Coroutine[Any, Any, list[Outcome]]) -> list[list[Outcome]]:
    """Runs side by side (each its own Runner and config), as many runs share one trajproxy."""

    async def main() -> list[list[Outcome]]:
        return list(await asyncio.gather(*runs))

    return asyncio.run(asyncio.wait_for(main(), timeout=60))


def test_episodes_turns_rewards_and_diffs_as_on_docker(
    proxy: LiveServer, sandboxes: LocalSandboxes, task: Task, image: Path
) -> None:
    """Two tasks at once (one of an image the runner builds first), each fixed by the agent: graded 1 in a fresh
    sandbox with the diff applied; the same task answered wrongly: 0."""
    built = replace(task, image="calc-built", build=image)
    solved, [wrong] = at_once(
        run_tasks(proxy, sandboxes, [task, built], "solve.script.jsonl", concurrency=2),
        run_tasks(proxy, sandboxes, [task], "wrong.script.jsonl"),
    )
    assert [(o.status, o.reward) for o in solved] == [("finished", 1.0)] * 2, [o.reason for o in solved]
    assert (wrong.status, wrong.reward) == ("finished", 0.0), wrong.reason
    assert all("-    return a - b\n+    return a + b" in o.diff for o in solved)
    assert "build_s" in solved[1].timings and "build_s" not in solved[0].timings
    assert sandboxes.images["calc-built"] == image

    with TrainerClient(proxy.url, proxy.token) as trainer:
        for outcome in solved:
            assert_fixed_and_graded(trainer, outcome, task.prompt)
            assert trainer.trajectory(str(outcome.episode_id)).rewards[0].info["grading"] == "fresh"
        assert trainer.trajectory(wrong.episode_id).rewards[0].value == 0.0  # type: ignore[arg-type]

    # each episode: its agent's sandbox, with the key to trajproxy, then a fresh one to grade in, with no network
    episodes = [str(o.episode_id) for o in (*solved, wrong)]
    agents = [spec for spec in sandboxes.started if spec.proxy]
    graders = [spec for spec in sandboxes.started if not spec.proxy]
    assert sorted(spec.labels["trajproxy.episode"] for spec in agents) == sorted(episodes)
    assert sorted(spec.labels["trajproxy.episode"] for spec in graders) == sorted(episodes)
    assert all(spec.env["OPENAI_BASE_URL"] == f"{proxy.url}/v1" for spec in agents)
    assert all(spec.env == {} for spec in graders)


def test_each_failure_is_recorded_and_the_other_tasks_carry_on(
    proxy: LiveServer, sandboxes: LocalSandboxes, task: Task
) -> None:
    missing = replace(task, image="no-such-image")
    slow_grader = replace(task, grader=ExitCode("sleep 30"))
    script = "solve.script.jsonl"
    [no_image], [crashed], [hung], [graded_slowly], [past_deadline] = at_once(
        run_tasks(proxy, sandboxes, [missing], script),
        run_tasks(proxy, sandboxes, [task], script, agent_cmd="echo boom >&2; exit 3"),
        run_tasks(proxy, sandboxes, [task], script, agent_cmd="sleep 30", agent_timeout_s=1),
        run_tasks(proxy, sandboxes, [slow_grader], script, grade_timeout_s=1),
        run_tasks(proxy, sandboxes, [task], script, agent_cmd="sleep 30", episode_timeout_s=1),
    )

    assert (no_image.status, no_image.reward) == ("failed", None)
    assert no_image.reason.startswith("image no-such-image not found")
    assert (crashed.status, crashed.reward) == ("failed", 0.0)  # graded all the same: nothing fixed
    assert crashed.reason == "the agent exited with 3: boom"
    assert (hung.status, hung.reward) == ("failed", 0.0)
    assert hung.reason == "the agent ran past its budget of 1 s"
    assert (graded_slowly.status, graded_slowly.reward) == ("finished", 0.0)
    assert (past_deadline.status, past_deadline.reward) == ("failed", None)
    assert past_deadline.reason == "the episode ran past its deadline of 1 s (start to graded)"

    with TrainerClient(proxy.url, proxy.token) as trainer:
        info = trainer.trajectory(graded_slowly.episode_id).rewards[0].info  # type: ignore[arg-type]
        assert info["grader"]["verdict"] == "the grader ran past 1 s"
        for outcome in (no_image, crashed, hung, graded_slowly, past_deadline):
            episode = trainer.episode(outcome.episode_id)  # type: ignore[arg-type]
            assert (episode.status, episode.reason) == (outcome.status, outcome.reason)


def test_agent_env_steps_the_agent_and_ends_with_its_reward(
    proxy: LiveServer, sandboxes: LocalSandboxes, task: Task
) -> None:
    replies = ScriptedPolicy(EXAMPLE / "solve.script.jsonl").replies

    async def main() -> tuple[list[int], float | None, Outcome | None]:
        async with AsyncTrainerClient(proxy.url, proxy.token) as trainer:
            async with AgentEnv(trainer, sandboxes, task, RunConfig(agent_cmd=AGENT_CMD)) as env:
                kinds: list[int] = []
                step = await env.reset()
                for reply in replies:
                    kinds.append(step.step_type)
                    step = await env.step(reply)
                kinds.append(step.step_type)
            return kinds, step.reward, env.outcome

    kinds, reward, outcome = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert kinds == [0, 1, 1, 2]  # FIRST, MID, MID, LAST
    assert reward == 1.0
    assert outcome is not None and (outcome.status, outcome.reward) == ("finished", 1.0)


def test_a_turn_budget_that_runs_out_ends_the_episode_truncated_not_failed(
    proxy: LiveServer, sandboxes: LocalSandboxes, task: Task, tmp_path: Path
) -> None:
    """--max-turns 1 on an agent that needs three calls: its second call is refused (429 budget_exceeded) and it
    exits non-zero, yet the episode is a truncation of the policy's attempt, graded and finished, so `trajproxy
    export --status finished` returns it and its line is no infrastructure failure."""
    [outcome] = asyncio.run(
        asyncio.wait_for(run_tasks(proxy, sandboxes, [task], "solve.script.jsonl", episode={"max_turns": 1}), 60)
    )
    assert (outcome.status, outcome.reward) == ("finished", 0.0), outcome.reason
    assert outcome.reason.startswith("truncated: over budget: the episode has used its 1 turns"), outcome.reason
    with TrainerClient(proxy.url, proxy.token) as trainer:
        episode = trainer.episode(str(outcome.episode_id))
        assert (episode.status, episode.reason) == ("finished", outcome.reason)
        assert episode.over_budget == "over budget: the episode has used its 1 turns"
    out = tmp_path / "finished.jsonl"
    with pytest.raises(SystemExit) as exported:
        main(["export", str(out), "--database-url", proxy.settings.database_url, "--status", "finished", "--quiet"])
    assert exported.value.code == 0
    [line] = [json.loads(text) for text in out.read_text().splitlines()]
    assert (line["episode_id"], line["status"], line["reward"]) == (outcome.episode_id, "finished", 0.0)
    assert infrastructure_failure(episode, line["reward"], None) is None  # the sample format's: a line to train on
