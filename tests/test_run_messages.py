"""What `trajproxy run` and `trajproxy --help` say, as a user reads it: no trainer awaited where none is needed,
a stopped episode counted as cancelled, progress printed every so often off a terminal. Real runs, real Docker."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from testkit.tasks import EXAMPLE
from tests.test_launch import RUN, TRAJPROXY, ended, into, started, wait_for

WAITING = "waiting for a trainer"


def progress_lines(said: str) -> list[str]:
    return [line for line in said.splitlines() if re.search(r"\d+/\d+ done", line)]


def test_help_says_what_the_commands_are() -> None:
    said = " ".join(subprocess.run([TRAJPROXY, "--help"], capture_output=True, text=True, timeout=30).stdout.split())
    assert "entry point" not in said and "handler" not in said
    for command in ("serve", "run", "export", "agents", "sandbox"):
        assert f"trajproxy {command}" in said, said


def test_a_run_with_no_task_to_run_waits_for_no_trainer(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("{oops\n")  # rejected: nothing is left to run
    command = [*RUN, str(tasks), "--agent-cmd", "true", *into(tmp_path / "run.db")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "not valid JSON" in done.stderr
    assert WAITING not in done.stderr


@pytest.mark.timeout(120)
def test_the_oracle_waits_for_no_trainer(tmp_path: Path, task_image: str, label: str) -> None:
    command = [*RUN, str(EXAMPLE / "tasks.jsonl"), "--agent", "oracle", "--label", label, *into(tmp_path / "run.db")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=100)
    assert "has no solution for the oracle" in done.stderr  # the example has none: the run did get that far
    assert WAITING not in done.stderr


@pytest.mark.timeout(120)
def test_off_a_terminal_a_long_run_prints_its_progress_every_so_often(
    tmp_path: Path, task_image: str, label: str
) -> None:
    stderr_file = tmp_path / "run.stderr"
    command = [*RUN, str(EXAMPLE / "tasks.jsonl"), "--agent-cmd", "sleep 5", "--progress-every-s", "1"]
    run = started([*command, "--label", label, *into(tmp_path / "run.db")], stderr_file)
    try:
        wait_for(lambda: len(progress_lines(stderr_file.read_text())) >= 2, "two progress lines", 60)
        assert run.poll() is None, stderr_file.read_text()  # printed while the task ran, not at the end
        assert "0/1 done, 1 running" in progress_lines(stderr_file.read_text())[0]
        assert ended(run, stderr_file) == 0, stderr_file.read_text()
    finally:
        run.kill()


@pytest.mark.timeout(240)
def test_a_stopped_run_counts_its_episode_as_cancelled_not_failed(
    tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    stderr_file = tmp_path / "run.stderr"
    command = [*RUN, str(EXAMPLE / "tasks.jsonl"), "--agent-cmd", "sleep 300", "--label", label]
    run = started([*command, *into(tmp_path / "run.db")], stderr_file)
    try:
        wait_for(lambda: len(engine.containers.list(filters={"label": label})) == 2, "the agent and its gate")
        run.send_signal(signal.SIGTERM)
        assert ended(run, stderr_file) == 143
    finally:
        run.kill()
    last = progress_lines(stderr_file.read_text())[-1]
    assert re.search(r"\b0 failed\b", last) and re.search(r"\b1 cancelled\b", last), last
