"""`trajproxy run` as a batch job: the results file grows as tasks end, a killed run keeps what ended, a run
restarted with --resume runs only what is not done, the exit status says whether every task ran, and
--keep-serving leaves the record readable until the run is stopped. Real runs, real Docker, SQLite."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.client import TrainerClient
from testkit.tasks import EXAMPLE
from tests.test_launch import RUN, ended, into, started, wait_for

SLOW = "Take your time."
MISSING_IMAGE = "localhost:1/trajproxy-test/missing:never"  # no such registry: fails at once, online or not
AGENT = f"grep -q '{SLOW}' {{task_file}} && sleep 300; true"  # an agent that does nothing, slowly when told


def tasks_file(folder: Path) -> Path:
    """Three tasks: one quickly done, one slow, one whose image is missing."""
    [example] = [json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()]
    slow = {**example, "prompt": f"{example['prompt']} {SLOW}"}
    missing = {**example, "metadata": {**example["metadata"], "image": MISSING_IMAGE}}
    path = folder / "tasks.jsonl"
    path.write_text("".join(json.dumps(task) + "\n" for task in (example, slow, missing)))
    return path


def lines_of(results: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []


def episodes_by_line(database: Path) -> list[tuple[int, str]]:
    with sqlite3.connect(database) as db:
        query = "SELECT json_extract(metadata, '$.line'), status FROM episode"
        return sorted(db.execute(query).fetchall())


@pytest.mark.timeout(300)
def test_a_killed_run_keeps_its_results_and_a_resumed_run_runs_only_what_is_not_done(
    tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    tasks, database, results = tasks_file(tmp_path), tmp_path / "run.db", tmp_path / "results.jsonl"
    stderr_file = tmp_path / "first.stderr"
    options = ["--concurrency", "3", "--label", label, "--results", str(results), *into(database)]
    first = started([*RUN, str(tasks), "--agent-cmd", AGENT, *options], stderr_file)
    try:
        wait_for(lambda: len(lines_of(results)) == 2, "the quick task and the missing image's to end", 120)
        assert first.poll() is None, stderr_file.read_text()  # the slow task is still under way
    finally:
        first.kill()  # SIGKILL: no clean-up, no chance to write anything more
        first.wait()
    quick, missing = sorted(lines_of(results), key=lambda line: line["task"])
    assert (quick["task"], quick["status"], quick["reward"]) == ("line 1", "finished", 0.0)
    assert {"start_s", "agent_s", "grade_s", "total_s"} <= quick["timings"].keys()
    assert quick["episode_id"].startswith("ep_") and quick["task_id"].startswith("line-1-")
    assert (missing["task"], missing["status"], missing["reward"]) == ("line 3", "failed", None)
    assert MISSING_IMAGE in missing["reason"]

    again = subprocess.run(
        [*RUN, str(tasks), "--agent-cmd", AGENT, "--agent-timeout-s", "5", "--resume", *options],
        capture_output=True,
        text=True,
        timeout=200,
    )  # the same agent (a task is done for the agent that ran it), cut short: the slow task ends graded, failed
    assert again.returncode == 1, again.stderr  # the missing image's task still could not run
    assert "resuming: 1 episode(s) a killed run left unfinished recorded as cancelled" in again.stderr
    assert "resuming: 1 of 3 task(s) done already by this agent, policy and grading, 2 to run" in again.stderr
    assert "1 task(s) run, 0 rejected, 1 could not run" in again.stderr
    later = lines_of(results)[2:]  # appended to what the killed run wrote
    assert sorted((line["task"], line["status"]) for line in later) == [("line 2", "failed"), ("line 3", "failed")]
    assert episodes_by_line(database) == [
        (1, "finished"),  # done: not run again
        (2, "cancelled"),  # the killed run's (its agent never called), closed by the run that resumed
        (2, "failed"),  # ran past its time, graded
        (3, "failed"),
        (3, "failed"),  # failed with no reward: run again
    ]


@pytest.mark.timeout(240)
def test_a_task_is_done_for_the_agent_that_ran_it_and_a_resumed_run_says_what_it_skipped(
    tmp_path: Path, task_image: str, label: str
) -> None:
    tasks = EXAMPLE / "tasks.jsonl"
    options = ["--label", label, *into(tmp_path / "run.db")]

    def run(agent_cmd: str) -> subprocess.CompletedProcess[str]:
        command = [*RUN, str(tasks), "--agent-cmd", agent_cmd, "--resume", *options]
        env = {**os.environ, "COLUMNS": "200"}
        return subprocess.run(command, capture_output=True, text=True, timeout=200, env=env)

    first = run("true")  # graded: reward 0, done for this agent
    assert first.returncode == 0 and "1 task(s) run" in first.stderr, first.stderr
    other = run("true # another agent")
    assert other.returncode == 0, other.stderr
    assert "0 of 1 task(s) done already by this agent, policy and grading, 1 to run" in other.stderr
    assert "1 task(s) run" in other.stderr
    same = run("true # another agent")
    assert same.returncode == 0, same.stderr
    assert "1 of 1 task(s) done already by this agent, policy and grading, 0 to run" in same.stderr
    [row] = [line for line in same.stderr.splitlines() if "skipped" in line and "│" in line]
    assert "done already" in row and re.search(r"ep_\w+", row), row
    assert "0 task(s) run, 0 rejected, 1 skipped as done already" in same.stderr


@pytest.mark.timeout(240)
def test_keep_serving_leaves_the_record_readable_until_the_run_is_stopped(
    tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    stderr_file = tmp_path / "run.stderr"
    script = f"scripted:{EXAMPLE / 'solve.script.jsonl'}"
    [example] = (EXAMPLE / "tasks.jsonl").read_text().splitlines()
    missing = json.loads(example)
    missing["metadata"]["image"] = MISSING_IMAGE
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(f"{example}\n{json.dumps(missing)}\n")  # one that runs, one whose sandbox cannot start
    command = [*RUN, str(tasks), "--agent", "minimal", "--policy", script, "--keep-serving"]
    run = started([*command, "--label", label, *into(tmp_path / "run.db")], stderr_file)
    try:
        wait_for(lambda: "serving what this run recorded at" in stderr_file.read_text(), "the run to serve", 120)
        said = stderr_file.read_text()
        url = re.search(r"serving what this run recorded at (\S+)", said)
        assert url is not None, said
        with TrainerClient(url.group(1)) as trainer:
            [episode] = [found for found in trainer.episodes().episodes if found.status == "finished"]
            rewards = trainer.trajectory(episode.id).rewards
        metrics = httpx.get(f"{url.group(1)}/metrics", timeout=10).text  # the run's sandboxes, counted in-process
        assert "\ntrajproxy_sandbox_starts_total 2.0\n" in metrics, (
            metrics
        )  # the agent's, the fresh one it is graded in
        assert "\ntrajproxy_sandbox_failures_total 1.0\n" in metrics, metrics
        assert [(reward.name, reward.value) for reward in rewards] == [("reward", 1.0)]
        assert episode.id in said.partition("serving what")[0]  # the table came first
        assert run.poll() is None
        run.send_signal(signal.SIGTERM)
        returncode = ended(run, stderr_file)
    finally:
        run.kill()
    assert returncode == 1, stderr_file.read_text()  # the run's own status: a task could not run
    assert not engine.containers.list(all=True, filters={"label": label})
