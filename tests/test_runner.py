"""The runner end to end: the minimal agent in a real container, answered by a scripted policy over the
trainer API, its diff graded in a fresh container, the reward in the database."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from proxy.client import AsyncTrainerClient, TrainerClient
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.backends.interface import Limits
from sandbox.run.policies import ScriptedPolicy
from sandbox.run.runner import Outcome, RunConfig, Runner
from sandbox.tasks.formats.jsonl import ExitCode
from sandbox.tasks.read import read_tasks
from sandbox.tasks.task import Task, TaskError
from testkit.tasks import BAKED_MINIMAL, EXAMPLE
from tests.conftest import mine


@pytest.fixture
def database_url(tmp_path: Any) -> str:
    return f"sqlite:///{tmp_path}/trajproxy.db"


def run_tasks(
    proxied: Any, sandboxes: DockerSandboxes, tasks: list[Task], script: str, concurrency: int = 1, **config: Any
) -> list[Outcome]:
    async def main() -> list[Outcome]:
        async with AsyncTrainerClient(proxied.url, proxied.token) as trainer:
            runner = Runner(
                trainer,
                sandboxes,
                ScriptedPolicy(EXAMPLE / script),
                RunConfig(agent_cmd=config.pop("agent_cmd", BAKED_MINIMAL), **config),
            )
            return await runner.run_many(tasks, concurrency=concurrency)

    return asyncio.run(main())


def test_a_right_fix_earns_1_and_a_wrong_one_0(
    proxied: Any, proxied_trainer: TrainerClient, sandboxes: DockerSandboxes, example_task: Task
) -> None:
    [solved] = run_tasks(proxied, sandboxes, [example_task], "solve.script.jsonl")
    [wrong] = run_tasks(proxied, sandboxes, [example_task], "wrong.script.jsonl")
    assert (solved.status, solved.reward) == ("finished", 1.0), solved.reason
    assert "return a + b" in solved.diff
    assert (wrong.status, wrong.reward) == ("finished", 0.0), wrong.reason

    assert_fixed_and_graded(proxied_trainer, solved, example_task.prompt)
    assert wrong.episode_id is not None
    assert proxied_trainer.trajectory(wrong.episode_id).rewards[0].value == 0.0


def assert_fixed_and_graded(trainer: TrainerClient, outcome: Outcome, prompt: str) -> None:
    """What the trainer API holds of an episode the minimal agent fixed by solve.script.jsonl: its three turns
    answered, the task its first message, the tests seen passing, and the grader's reward of 1."""
    recorded = trainer.trajectory(str(outcome.episode_id))
    assert recorded.episode.status == "finished"
    assert [turn.status for turn in recorded.turns] == ["answered"] * 3
    assert recorded.turns[0].request["messages"][1]["content"] == prompt
    assert "exit code 0" in recorded.turns[2].request["messages"][-1]["content"]  # it saw the tests pass
    [reward] = recorded.rewards
    assert (reward.name, reward.value, reward.source) == ("reward", 1.0, "grader")
    assert reward.info["grader"]["verdict"] == "tests pass"


def test_eight_tasks_at_concurrency_four(
    proxied: Any, proxied_trainer: TrainerClient, sandboxes: DockerSandboxes, example_task: Task
) -> None:
    outcomes = run_tasks(proxied, sandboxes, [example_task] * 8, "solve.script.jsonl", concurrency=4)
    assert [(o.status, o.reward) for o in outcomes] == [("finished", 1.0)] * 8
    assert len({o.episode_id for o in outcomes}) == 8
    episodes = proxied_trainer.episodes(status="finished").episodes
    assert len(episodes) == 8


def test_failures_are_recorded_and_the_other_tasks_carry_on(
    proxied: Any, proxied_trainer: TrainerClient, sandboxes: DockerSandboxes, example_task: Task
) -> None:
    missing = Task(**{**_fields(example_task), "image": "trajproxy-test/no-such-image:404"})
    crashing, hanging, slow_grader = (
        example_task,
        example_task,
        Task(**{**_fields(example_task), "grader": ExitCode("sleep 60")}),
    )
    [no_image] = run_tasks(proxied, sandboxes, [missing], "solve.script.jsonl")
    assert (no_image.status, no_image.reward) == ("failed", None)
    assert "not found" in no_image.reason

    [crashed] = run_tasks(proxied, sandboxes, [crashing], "solve.script.jsonl", agent_cmd="echo boom >&2; exit 3")
    assert (crashed.status, crashed.reward) == ("failed", 0.0)
    assert "exited with 3" in crashed.reason

    [hung] = run_tasks(proxied, sandboxes, [hanging], "solve.script.jsonl", agent_cmd="sleep 60", agent_timeout_s=2)
    assert hung.status == "failed" and "budget" in hung.reason

    [graded_slowly] = run_tasks(proxied, sandboxes, [slow_grader], "solve.script.jsonl", grade_timeout_s=2)
    assert graded_slowly.reward == 0.0
    assert graded_slowly.episode_id is not None
    info = proxied_trainer.trajectory(graded_slowly.episode_id).rewards[0].info
    assert "ran past" in info["grader"]["verdict"]

    for outcome in (no_image, crashed, hung, graded_slowly):
        assert outcome.episode_id is not None
        episode = proxied_trainer.episode(outcome.episode_id)
        assert (episode.status, episode.reason) == (outcome.status, outcome.reason)


def test_an_episode_past_its_deadline_is_stopped_wherever_it_is_stuck(
    proxied: Any, proxied_trainer: TrainerClient, sandboxes: DockerSandboxes, example_task: Task
) -> None:
    """A grader that never ends, with all the grading time in the world: the episode's deadline (start to graded)
    stops it, removes its sandbox (the fixture checks none is left) and records the episode failed, with no reward."""
    wedged = Task(**{**_fields(example_task), "grader": ExitCode("sleep infinity")})
    [outcome] = run_tasks(
        proxied, sandboxes, [wedged], "solve.script.jsonl", grade_timeout_s=3600, episode_timeout_s=15
    )
    assert (outcome.status, outcome.reward) == ("failed", None)
    assert outcome.reason == "the episode ran past its deadline of 15 s (start to graded)"
    assert outcome.episode_id is not None
    recorded = proxied_trainer.trajectory(outcome.episode_id)
    assert (recorded.episode.status, recorded.rewards) == ("failed", [])
    assert [turn.status for turn in recorded.turns] == ["answered"] * 3  # the agent's part ran, the grade never did


def test_an_interrupted_run_cancels_its_episodes_and_leaves_no_container(
    proxied: Any, sandboxes: DockerSandboxes, example_task: Task, engine: Any
) -> None:
    async def main() -> list[str]:
        async with AsyncTrainerClient(proxied.url, proxied.token) as trainer:
            runner = Runner(
                trainer,
                sandboxes,
                ScriptedPolicy(EXAMPLE / "solve.script.jsonl"),
                RunConfig(agent_cmd="sleep 300", limits=Limits(cpus=0.5)),
            )
            run = asyncio.create_task(runner.run_many([example_task] * 3, concurrency=3))
            for _ in range(600):  # until the 3 agents and their gates run
                if len(engine.containers.list(filters={"label": mine(sandboxes)})) >= 6:
                    break
                await asyncio.sleep(0.1)
            run.cancel()  # what Ctrl-C does
            with pytest.raises(asyncio.CancelledError):
                await run
            listed = await trainer.episodes()
            return [episode.status for episode in listed.episodes]

    statuses = asyncio.run(asyncio.wait_for(main(), timeout=120))
    assert statuses == ["cancelled"] * 3
    assert not engine.containers.list(all=True, filters={"label": mine(sandboxes)})


def test_task_files_explain_what_is_wrong(tmp_path: Path) -> None:
    lines = [
        {"prompt": "ok", "metadata": {"image": "img", "workdir": "/w", "eval_cmd": "true"}},
        {"prompt": "no eval", "metadata": {"image": "img"}},
        "this is not json",
        {"prompt": "x", "metadata": {"eval_cmd": "true"}},
        {"prompt": "overridden", "metadata": {"problem_statement": "the real one", "image": "i", "eval_cmd": "t"}},
        {"prompt": "both", "metadata": {"image": "i", "eval_cmd": "t", "remote_env_info": {"f2p_script": "x"}}},
        {"prompt": "locked", "metadata": {"image": "i", "eval_cmd": "t", "read_only": True}},
        {"prompt": "locked?", "metadata": {"image": "i", "eval_cmd": "t", "read_only": "yes"}},
        {"prompt": "set up", "metadata": {"eval_cmd": "t", "remote_env_info": {"image_url": "i", "pre_commands": "x"}}},
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines))
    parsed = list(read_tasks(path))
    assert isinstance(parsed[0], Task) and parsed[0].workdir == "/w"
    assert isinstance(parsed[1], TaskError) and "line 2" in str(parsed[1]) and "eval_cmd" in str(parsed[1])
    assert isinstance(parsed[2], TaskError) and "not valid JSON" in str(parsed[2])
    assert isinstance(parsed[3], TaskError) and "image" in str(parsed[3])
    assert isinstance(parsed[4], Task) and parsed[4].prompt == "the real one"
    assert isinstance(parsed[5], Task) and parsed[5].grader == ExitCode("t")  # eval_cmd first, as slime grades
    assert isinstance(parsed[6], Task) and parsed[6].read_only and not parsed[5].read_only
    assert isinstance(parsed[7], TaskError) and "metadata.read_only must be true or false, not 'yes'" in str(parsed[7])
    assert isinstance(parsed[8], Task) and parsed[8].setup == "x" and parsed[8].image == "i"
    assert [t.image for t in read_tasks(path, image="forced") if isinstance(t, Task)] == ["forced"] * 6


def _fields(task: Task) -> dict[str, Any]:
    return {name: getattr(task, name) for name in Task.__slots__}
