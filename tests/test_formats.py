"""The task formats users already have, end to end in sandboxes: a folder of Harbor tasks (built from their own
environment, checked with the oracle, solved by an injected agent under a scripted policy, a verifier's named
rewards) and SWE-bench-shaped instances graded by the swebench package (one resolved, one not)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from proxy.client import AsyncTrainerClient, TrainerClient
from sandbox.agents.bundles import Bundles
from sandbox.agents.injection import InjectedAgent
from sandbox.agents.manifests import load
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.run.policies import Policy, ScriptedPolicy, TrainerPolicy
from sandbox.run.runner import Outcome, RunConfig, Runner
from sandbox.tasks.formats import harbor, swebench
from sandbox.tasks.read import read_tasks
from sandbox.tasks.task import Task, TaskError
from testkit.tasks import ROOT

HARBOR = ROOT / "examples" / "tasks" / "harbor"
SWEBENCH = ROOT / "examples" / "tasks" / "swebench"
SWE_IMAGES = "trajproxy-example/sweb.{instance_id}"


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/trajproxy.db"


@pytest.fixture(scope="session")
def minimal() -> InjectedAgent:
    manifest = load("minimal")
    return InjectedAgent(manifest, Bundles().ensure(manifest), None)


@pytest.fixture(scope="session")
def swe_images(engine: Any) -> str:
    """One image per instance, laid out as SWE-bench's are, from the example's Dockerfile."""
    for instance in ("calc__calc-1", "calc__calc-2"):
        tag = SWE_IMAGES.format(instance_id=instance)
        engine.images.build(path=str(SWEBENCH), tag=tag, buildargs={"INSTANCE": instance}, rm=True)
    return SWE_IMAGES


def run(proxied: Any, sandboxes: DockerSandboxes, tasks: list[Task], policy: Policy, **config: Any) -> list[Outcome]:
    async def main() -> list[Outcome]:
        async with AsyncTrainerClient(proxied.url, proxied.token) as trainer:
            runner = Runner(trainer, sandboxes, policy, RunConfig(**config))
            return await runner.run_many(tasks, concurrency=2)

    return asyncio.run(main())


def tasks_at(path: Path, **options: Any) -> list[Task]:
    parsed = list(read_tasks(path, **options))
    assert all(isinstance(task, Task) for task in parsed), parsed
    return [task for task in parsed if isinstance(task, Task)]


def recorded_rewards(trainer: TrainerClient, outcome: Outcome) -> dict[str, float]:
    assert outcome.episode_id is not None
    rewards = trainer.trajectory(outcome.episode_id).rewards
    assert all(reward.source == "grader" for reward in rewards)
    return {reward.name: reward.value for reward in rewards}


def test_the_oracle_solves_every_harbor_task_and_named_rewards_are_recorded(
    proxied: Any, proxied_trainer: TrainerClient, sandboxes: DockerSandboxes
) -> None:
    tasks = tasks_at(HARBOR)
    assert [task.id for task in tasks] == ["fix-calc", "hello-world", "word-count"]
    outcomes = run(proxied, sandboxes, tasks, TrainerPolicy(), oracle=True)
    by_id = {outcome.task.id: outcome for outcome in outcomes}
    assert {id: (o.status, o.reward) for id, o in by_id.items()} == {
        "fix-calc": ("finished", 1.0),
        "hello-world": ("finished", 1.0),
        "word-count": ("finished", 1.0),
    }
    assert recorded_rewards(proxied_trainer, by_id["hello-world"]) == {"reward": 1.0}
    assert recorded_rewards(proxied_trainer, by_id["word-count"]) == {"reward": 1.0, "count": 1.0, "format": 1.0}
    assert "reward.json" in by_id["word-count"].reason
    assert {"build_s", "agent_s", "grade_s", "total_s"} <= by_id["hello-world"].timings.keys()
    assert by_id["hello-world"].episode_id is not None
    episode = proxied_trainer.episode(by_id["hello-world"].episode_id)
    assert episode.metadata["task_id"] == "hello-world"
    assert episode.metadata["harbor"]["metadata"]["tags"] == ["trivial"]  # task.toml's own keys, kept


def test_an_injected_agent_solves_a_harbor_task_and_never_sees_its_tests(
    proxied: Any, proxied_trainer: TrainerClient, sandboxes: DockerSandboxes, minimal: InjectedAgent
) -> None:
    [task] = tasks_at(HARBOR / "fix-calc")
    script = ScriptedPolicy(HARBOR / "fix-calc.script.jsonl")
    [solved] = run(proxied, sandboxes, [task], script, agent=minimal)
    assert (solved.status, solved.reward) == ("finished", 1.0), solved
    assert recorded_rewards(proxied_trainer, solved) == {"reward": 1.0}
    assert solved.episode_id is not None
    turns = proxied_trainer.trajectory(solved.episode_id).turns
    seen = str(turns[1].request["messages"][-1]["content"])  # what `ls -a /app /tests` showed the agent
    assert "calc.py" in seen and "cannot access '/tests'" in seen

    wrong = ScriptedPolicy(ROOT / "examples" / "tasks" / "calc" / "wrong.script.jsonl")
    [left_alone] = run(proxied, sandboxes, [task], wrong, agent=minimal)
    assert (left_alone.status, left_alone.reward) == ("finished", 0.0)


def test_a_verifier_that_writes_no_number_grades_zero_and_says_why(
    proxied: Any, sandboxes: DockerSandboxes, tmp_path: Path
) -> None:
    for name, verifier in {
        "words": "echo lots > /logs/verifier/reward.txt",
        "nothing": "true",
        "broken-json": "echo '{\"a\": 1,' > /logs/verifier/reward.json",
    }.items():
        folder = _copy(HARBOR / "hello-world", tmp_path / name)
        (folder / "tests" / "test.sh").write_text(f"#!/bin/bash\n{verifier}\n")
    outcomes = run(proxied, sandboxes, tasks_at(tmp_path), TrainerPolicy(), oracle=True)
    verdicts = {o.task.id: (o.reward, o.reason) for o in outcomes}
    assert verdicts["words"] == (0.0, "reward.txt holds 'lots', not a number")
    assert verdicts["nothing"][0] == 0.0 and "wrote no reward" in verdicts["nothing"][1]
    assert verdicts["broken-json"][0] == 0.0 and "not valid JSON" in verdicts["broken-json"][1]


def test_harbor_tasks_run_with_a_read_only_root_per_task_or_per_run(
    proxied: Any, sandboxes: DockerSandboxes, tmp_path: Path
) -> None:
    """A read-only root (task.toml's `read_only = true`, or the run's `--read-only`): the image's own working directory
    keeps its files and can be changed, the oracle's /solution and the verifier's /tests and /logs can be copied in
    and written, and nothing else can: the verifier below grades 0 if its root takes a write."""
    hello = _copy(HARBOR / "hello-world", tmp_path / "hello-world")  # the same name and image as the example's
    (hello / "task.toml").write_text((hello / "task.toml").read_text() + "read_only = true\n")  # in [environment]
    fix = _copy(HARBOR / "fix-calc", tmp_path / "fix-calc")
    refused = "touch /usr/trajproxy-probe 2>&1 | grep -q 'Read-only file system'"
    for verifier in (hello / "tests" / "test.sh", fix / "tests" / "test.sh"):
        verifier.write_text(
            f"#!/bin/bash\n{refused} || {{ echo 0 > /logs/verifier/reward.txt; exit; }}\n{verifier.read_text()}"
        )
    [per_task] = tasks_at(hello)
    assert per_task.read_only and not harbor.parse(fix).read_only
    outcomes = run(proxied, sandboxes, [per_task], TrainerPolicy(), oracle=True)
    outcomes += run(proxied, sandboxes, tasks_at(fix), TrainerPolicy(), oracle=True, read_only=True)
    assert [(o.task.id, o.status, o.reward) for o in outcomes] == [
        ("hello-world", "finished", 1.0),
        ("fix-calc", "finished", 1.0),  # its oracle edited /app/calc.py, a file the image shipped
    ], [o.reason for o in outcomes]
    [writable] = run(proxied, sandboxes, tasks_at(fix), TrainerPolicy(), oracle=True)  # the default: a writable root
    assert (writable.status, writable.reward) == ("finished", 0.0)


def test_a_task_image_is_built_once_for_its_content(engine: Any, sandboxes: DockerSandboxes, tmp_path: Path) -> None:
    folder = _copy(HARBOR / "hello-world", tmp_path / "cached")
    dockerfile = folder / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + f"LABEL trajproxy.test.run={tmp_path.name}\n")
    task = harbor.parse(folder)
    assert task.build is not None and task.image.startswith("trajproxy-task/cached:")
    assert harbor.parse(folder).image == task.image  # the same content, the same tag
    try:
        assert asyncio.run(sandboxes.build(task.build, task.image, 300)) is True
        assert asyncio.run(sandboxes.build(task.build, task.image, 300)) is False
        dockerfile.write_text(dockerfile.read_text() + "ENV CHANGED=1\n")
        assert harbor.parse(folder).image != task.image
    finally:
        engine.images.remove(task.image, force=True)


def test_harbor_task_directories_explain_what_is_wrong(tmp_path: Path) -> None:
    cases: dict[str, Callable[[Path], object]] = {
        "no-instruction": lambda f: (f / "instruction.md").write_text("  \n"),
        "bad-toml": lambda f: (f / "task.toml").write_text("[agent\n"),
        "bad-memory": lambda f: (f / "task.toml").write_text('[environment]\nmemory = "lots"\n'),
        "bad-timeout": lambda f: (f / "task.toml").write_text("[agent]\ntimeout_sec = -1\n"),
        "no-verifier": lambda f: (f / "tests" / "test.sh").unlink(),
        "no-environment": lambda f: shutil.rmtree(f / "environment"),
    }
    for name, spoil in cases.items():
        spoil(_copy(HARBOR / "hello-world", tmp_path / name))
    said = {str(error).split(":")[0]: str(error) for error in read_tasks(tmp_path)}
    assert all(isinstance(error, TaskError) for error in read_tasks(tmp_path))
    assert "instruction.md" in said["task no-instruction"]
    assert "not valid TOML" in said["task bad-toml"]
    assert "'lots' is not a size" in said["task bad-memory"]
    assert "positive number of seconds" in said["task bad-timeout"]
    assert "tests/test.sh" in said["task no-verifier"]
    assert "environment/Dockerfile" in said["task no-environment"]
    [empty] = read_tasks(tmp_path / "no-environment" / "tests")
    assert "no Harbor task here" in str(empty)


def test_a_harbor_task_takes_its_resources_and_budgets_from_task_toml() -> None:
    fix, hello = harbor.parse(HARBOR / "fix-calc"), harbor.parse(HARBOR / "hello-world")
    assert fix.limits is not None and fix.limits.memory_bytes == 2 * 1024**3
    assert hello.limits is not None and (hello.limits.cpus, hello.limits.memory_bytes) == (1.0, 1024**3)
    assert (hello.agent_timeout_s, hello.grade_timeout_s, hello.grading) == (120.0, 60.0, "in-place")
    assert harbor.parse(HARBOR / "word-count").grader == harbor.Verifier(
        HARBOR / "word-count" / "tests", {"EXPECTED": "9"}
    )


@pytest.mark.timeout(300)  # five sandboxed episodes and the containers grading them: minutes on a busy engine
def test_swebench_instances_are_graded_by_the_swebench_harness(
    proxied: Any, proxied_trainer: TrainerClient, sandboxes: DockerSandboxes, minimal: InjectedAgent, swe_images: str
) -> None:
    tasks = tasks_at(SWEBENCH / "instances.jsonl", image_template=swe_images)
    assert [(t.id, t.image, t.grading) for t in tasks] == [
        ("calc__calc-1", "trajproxy-example/sweb.calc__calc-1", "fresh"),
        ("calc__calc-2", "trajproxy-example/sweb.calc__calc-2", "fresh"),
    ]
    # The script fixes add(): it resolves the first instance, whose bug that is, and not the second.
    fixed, unfixed = run(proxied, sandboxes, tasks, ScriptedPolicy(SWEBENCH / "solve.script.jsonl"), agent=minimal)
    assert (fixed.status, fixed.reward, fixed.reason) == ("finished", 1.0, "resolved")
    assert "-    return a - b\n+    return a + b" in fixed.diff
    assert (unfixed.reward, unfixed.reason) == (0.0, "not resolved: 2 test(s) fail")
    assert unfixed.episode_id is not None
    info = proxied_trainer.trajectory(unfixed.episode_id).rewards[0].info
    status = info["grader"]["tests_status"]
    assert status["FAIL_TO_PASS"]["failure"] == ["tests/test_calc.py::test_mul", "tests/test_calc.py::test_mul_one"]
    assert status["PASS_TO_PASS"]["success"] == ["tests/test_calc.py::test_add_zero"]

    # The gold patches resolve both, graded fresh by default and in place when asked.
    gold = run(proxied, sandboxes, tasks, TrainerPolicy(), oracle=True)
    assert [(o.reward, o.reason) for o in gold] == [(1.0, "resolved")] * 2
    [in_place] = run(proxied, sandboxes, tasks[:1], TrainerPolicy(), oracle=True, grading="in-place")
    assert (in_place.reward, in_place.reason) == (1.0, "resolved")


F2P_SCRIPT = """import os, sys, tempfile
import pytest

TEST = "from calc import add, sub\\n\\n\\ndef test_add():\\n    assert add(2, 3) == 5 and sub(3, 1) == 2\\n"
path = os.path.join(tempfile.mkdtemp(), "test_f2p.py")
with open(path, "w") as f:
    f.write(TEST)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", path]))
"""


def test_slimes_swe_rows_are_graded_by_their_f2p_script(
    proxied: Any,
    proxied_trainer: TrainerClient,
    sandboxes: DockerSandboxes,
    swe_images: str,
    minimal: InjectedAgent,
    tmp_path: Path,
) -> None:
    """A row shaped like slime's SWE rows, taken as it is: no eval_cmd, no image or workdir in `metadata`, but
    `remote_env_info` with `image_url`, `workdir`, `instance_id` and `f2p_script`, which grades the agent's work,
    and `pre_commands` (here they commit a `sub` that the tests need), run before the agent and before the grade."""
    row: dict[str, Any] = {  # a JSON row
        "prompt": "unused: metadata.problem_statement is the task",
        "label": "calc__calc-1",
        "metadata": {
            "problem_statement": "add() in calc.py returns the wrong result. Make it return the sum.",
            "remote_env_info": {
                "instance_id": "calc__calc-1",
                "image_url": swe_images.format(instance_id="calc__calc-1"),
                "workdir": "/testbed",
                "f2p_script": F2P_SCRIPT,
                "pre_commands": [
                    "printf 'def sub(a, b):\\n    return -(b - a)\\n' >> calc.py",
                    "git -c user.email=t@example.com -c user.name=t commit -qam 'the base: sub added'",
                ],
            },
        },
    }
    (tmp_path / "slime.jsonl").write_text(json.dumps(row) + "\n")
    [task] = tasks_at(tmp_path / "slime.jsonl")
    assert (task.id, task.workdir, task.prompt) == ("calc__calc-1", "/testbed", row["metadata"]["problem_statement"])
    solved, wrong = (
        run(proxied, sandboxes, [task], ScriptedPolicy(script), agent=minimal)[0]
        for script in (SWEBENCH / "solve.script.jsonl", ROOT / "examples" / "tasks" / "calc" / "wrong.script.jsonl")
    )
    assert (solved.status, solved.reward, solved.reason) == ("finished", 1.0, "tests pass"), solved.agent_output
    assert (wrong.status, wrong.reward) == ("finished", 0.0)
    assert solved.episode_id is not None
    seen = proxied_trainer.trajectory(solved.episode_id).turns[1].request["messages"][-1]
    assert "def sub(a, b)" in str(seen["content"]) and "def sub" not in solved.diff  # `cat calc.py` after the setup
    assert wrong.episode_id is not None
    said = proxied_trainer.trajectory(wrong.episode_id).rewards[0].info
    assert "1 failed" in said["grader"]["output"]  # pytest's own summary: the script ran its test


def test_swebench_instances_explain_what_is_wrong(tmp_path: Path) -> None:
    instance = json.loads((SWEBENCH / "instances.jsonl").read_text().splitlines()[0])
    lines = [
        {**instance, "version": "99.9"},
        {key: value for key, value in instance.items() if key != "test_patch"},
        {**instance, "FAIL_TO_PASS": "not a list"},
        {**instance, "image": "given/by-the-instance"},
    ]
    path = tmp_path / "instances.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\nnot json\n")
    parsed = list(read_tasks(path))
    assert "no test spec for pallets/flask version 99.9" in str(parsed[0])
    assert "needs test_patch" in str(parsed[1])
    assert "FAIL_TO_PASS must be a list" in str(parsed[2])
    assert isinstance(parsed[3], Task) and parsed[3].image == "given/by-the-instance"
    assert "line 5: not valid JSON" in str(parsed[4])
    default = swebench.parse(instance)
    assert default.image == "swebench/sweb.eval.x86_64.calc_1776_calc-1:latest"  # as swebench's harness names it
    assert replace(default, image="x").solver is not None  # the gold patch, for --agent oracle


def test_trajproxy_run_checks_datasets_with_the_oracle(
    engine: Any, swe_images: str, tmp_path: Path, label: str
) -> None:
    results = tmp_path / "run.db"
    command = [str(Path(sys.executable).parent / "trajproxy"), "run", str(HARBOR), "--agent", "oracle"]
    options = ["--port", "0", "--database-url", f"sqlite:///{results}", "--label", label]
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run([*command, *options], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    assert "3 task(s) run, 0 rejected, mean reward 1.000" in done.stderr
    for task in ("fix-calc", "hello-world", "word-count"):
        assert task in done.stderr
    assert not engine.containers.list(all=True, filters={"label": label})

    swe = [str(SWEBENCH / "instances.jsonl"), "--image-template", SWE_IMAGES]
    done = subprocess.run([*command[:2], *swe, "--agent", "oracle", *options], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "2 task(s) run, 0 rejected, mean reward 1.000" in done.stderr
    assert "HTTP Request" not in done.stderr  # importing swebench sets up logging; the run puts it back

    missing = subprocess.run(
        [*command[:2], str(tmp_path / "nowhere"), "--agent", "oracle"], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "no such file or directory" in missing.stderr


def _copy(task: Path, to: Path) -> Path:
    shutil.copytree(task, to)
    return to
