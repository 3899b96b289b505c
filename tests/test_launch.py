"""`trajproxy run` and `trajproxy sandbox prune` as a user runs them: a subprocess, real Docker, SQLite."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import EXAMPLE

TRAJPROXY = str(Path(sys.executable).parent / "trajproxy")
RUN = [TRAJPROXY, "run", "--port", "0"]


def into(database: Path) -> list[str]:
    return ["--database-url", f"sqlite:///{database}"]


def episodes_in(database: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(database) as db:
        return sorted(db.execute("SELECT status, coalesce(reason, '') FROM episode").fetchall())


def test_run_grades_the_good_lines_and_records_the_bad_ones(tmp_path: Path, task_image: str, engine: Any) -> None:
    tasks = tmp_path / "tasks.jsonl"
    good = (EXAMPLE / "tasks.jsonl").read_text().strip()
    tasks.write_text("\n".join([good, json.dumps({"prompt": "p", "metadata": {"image": "i"}}), "{oops", good]))
    database = tmp_path / "run.db"
    script = f"scripted:{EXAMPLE / 'solve.script.jsonl'}"
    done = subprocess.run(
        [*RUN, str(tasks), "--agent", "minimal", "--concurrency", "2", "--policy", script, *into(database)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "needs metadata.eval_cmd" in done.stderr
    assert "not valid JSON" in done.stderr
    assert "2 task(s) run, 2 rejected, mean reward 1.000" in done.stderr
    recorded = episodes_in(database)
    assert [status for status, _ in recorded] == ["failed", "failed", "finished", "finished"]
    assert not engine.containers.list(all=True, filters={"label": "trajproxy.managed=1"})


def test_ctrl_c_cancels_the_run_and_removes_every_container(tmp_path: Path, task_image: str, engine: Any) -> None:
    database = tmp_path / "run.db"
    run = subprocess.Popen(
        [*RUN, str(EXAMPLE / "tasks.jsonl"), "--agent-cmd", "sleep 300", *into(database)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(engine.containers.list(filters={"label": "trajproxy.managed=1"})) < 2:  # the agent and its gate
            assert time.monotonic() < deadline, "the run never started its sandbox"
            time.sleep(0.2)
        run.send_signal(signal.SIGINT)
        _, stderr = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130, stderr
    assert "interrupted" in stderr
    assert [status for status, _ in episodes_in(database)] == ["cancelled"]
    assert not engine.containers.list(all=True, filters={"label": "trajproxy.managed=1"})


def test_sandbox_prune_removes_what_a_crash_left(engine: Any) -> None:
    left = engine.containers.run("python:3.11-slim", ["sleep", "300"], detach=True, labels={"trajproxy.managed": "1"})
    try:
        done = subprocess.run([TRAJPROXY, "sandbox", "prune"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "removed 1 container(s)" in done.stderr
        with pytest.raises(Exception, match=r"404|No such container"):
            left.reload()
    finally:
        subprocess.run(["docker", "rm", "-f", left.id], capture_output=True)
