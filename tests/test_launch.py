"""`trajproxy run` and `trajproxy sandbox prune` as a user runs them: a subprocess, real Docker, SQLite.

The engine is shared (another test run, another user's `trajproxy run`): each run here carries a label of its
own, and every check on containers looks at that label only."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sandbox.backends.identity import RunIdentity
from sandbox.backends.images import MANAGED
from testkit.tasks import EXAMPLE
from tests.conftest import SANDBOX_IMAGE
from tests.test_sandbox import exited_run

TRAJPROXY = str(Path(sys.executable).parent / "trajproxy")
RUN = [TRAJPROXY, "run", "--port", "0"]


def into(database: Path) -> list[str]:
    return ["--database-url", f"sqlite:///{database}"]


def episodes_in(database: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(database) as db:
        return sorted(db.execute("SELECT status, coalesce(reason, '') FROM episode").fetchall())


def test_run_grades_the_good_lines_and_records_the_bad_ones(
    tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    """Bad lines are recorded as rejected, the good ones run; the exit status says some were rejected, and the
    table, read from a pipe as CI reads it, names every episode in full."""
    tasks = tmp_path / "tasks.jsonl"
    good = (EXAMPLE / "tasks.jsonl").read_text().strip()
    tasks.write_text("\n".join([good, json.dumps({"prompt": "p", "metadata": {"image": "i"}}), "{oops", good]))
    database = tmp_path / "run.db"
    script = f"scripted:{EXAMPLE / 'solve.script.jsonl'}"
    command = [*RUN, str(tasks), "--agent", "minimal", "--concurrency", "2", "--policy", script, "--label", label]
    results = tmp_path / "results.jsonl"
    done = subprocess.run(
        [*command, "--results", str(results), *into(database)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "60"},
    )
    assert done.returncode == 1, done.stderr
    assert "needs metadata.eval_cmd" in done.stderr
    assert "not valid JSON" in done.stderr
    assert "2 task(s) run, 2 rejected, mean reward 1.000" in done.stderr, done.stderr[-4000:]
    recorded = episodes_in(database)
    assert [status for status, _ in recorded] == ["failed", "failed", "finished", "finished"]
    with sqlite3.connect(database) as db:
        finished = [row[0] for row in db.execute("SELECT id FROM episode WHERE status = 'finished'")]
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted((line["status"], line["task"], line["episode_id"] in finished) for line in lines) == [
        ("finished", "line 1", True),
        ("finished", "line 4", True),
        ("rejected", None, False),
        ("rejected", None, False),
    ]
    table = [line for line in done.stderr.splitlines() if "│" in line]
    for episode_id in finished:
        assert sum(episode_id in line for line in table) == 1, (episode_id, done.stderr)
    assert not engine.containers.list(all=True, filters={"label": label})


def as_at_a_terminal() -> None:
    """A run's stopping signals as a terminal leaves them: a test run started in the background (as CI may be) has
    SIGINT ignored, under nohup SIGHUP too, and its children would inherit that and never hear them."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def started(command: list[str], stderr_file: Path, **options: Any) -> subprocess.Popen[bytes]:
    """A `trajproxy run` in the background, its stderr to a file (never a pipe nobody reads while the test waits:
    it could fill and block), able to dump every thread's stack on SIGABRT."""
    with stderr_file.open("w") as sink:
        return subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=sink,
            env={**os.environ, "PYTHONFAULTHANDLER": "1", **options.pop("env", {})},
            preexec_fn=as_at_a_terminal,
            **options,
        )


def wait_for(ready: Callable[[], bool], what: str, timeout_s: float = 60, every_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)


def ended(run: subprocess.Popen[bytes], stderr_file: Path, timeout_s: float = 120) -> int:
    try:
        return run.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        run.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack to its stderr
        run.wait(timeout=10)
        pytest.fail(f"the run did not end within {timeout_s} s:\n{stderr_file.read_text()[-6000:]}")


@pytest.mark.timeout(240)  # a start, then a stop that waits on Docker: slow on a busy shared engine
@pytest.mark.parametrize(
    ("stop", "again", "status"),
    [(signal.SIGINT, signal.SIGTERM, 130), (signal.SIGTERM, signal.SIGINT, 143), (signal.SIGHUP, signal.SIGTERM, 129)],
    ids=["ctrl-c", "sigterm", "sighup"],
)
def test_a_stopping_signal_cancels_the_run_and_removes_every_container(
    tmp_path: Path, task_image: str, engine: Any, label: str, stop: signal.Signals, again: signal.Signals, status: int
) -> None:
    """Ctrl-C, a batch scheduler's SIGTERM and a closed terminal's SIGHUP stop a run alike: its episode is recorded
    as cancelled, its containers removed, its trajproxy shut down, and the exit status names the signal. A second
    signal, sent while the run cleans up, is told to wait and does not cut the clean-up short."""
    database = tmp_path / "run.db"
    stderr_file = tmp_path / "run.stderr"
    command = [*RUN, str(EXAMPLE / "tasks.jsonl"), "--agent-cmd", "sleep 300", "--label", label, *into(database)]
    run = started(command, stderr_file)
    try:
        wait_for(lambda: len(engine.containers.list(filters={"label": label})) == 2, "the agent and its gate")
        run.send_signal(stop)
        wait_for(lambda: f"{stop.name}: stopping" in stderr_file.read_text(), "the run to say it stops", every_s=0.01)
        run.send_signal(again)  # the clean-up (closing an episode over HTTP, removing containers) has just begun
        returncode = ended(run, stderr_file)
    finally:
        run.kill()
    stderr = stderr_file.read_text()
    assert returncode == status, stderr
    assert f"{stop.name}: stopping" in stderr
    assert f"{again.name} again: still stopping" in stderr
    assert f"interrupted ({stop.name})" in stderr
    assert episodes_in(database) == [("cancelled", "the run was interrupted")]
    assert not engine.containers.list(all=True, filters={"label": label})


@pytest.mark.timeout(240)
def test_a_run_whose_terminal_hangs_up_still_cleans_up(
    tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    """A closed terminal (an ssh session dropped): the run gets SIGHUP, and every write to its terminal fails from
    then on. It cleans up all the same and exits as a hung-up process does."""
    database = tmp_path / "run.db"
    command = [*RUN, str(EXAMPLE / "tasks.jsonl"), "--agent-cmd", "sleep 300", "--label", label, *into(database)]
    terminal, its_end = pty.openpty()
    run = subprocess.Popen(command, stdin=its_end, stdout=its_end, stderr=its_end, preexec_fn=as_at_a_terminal)
    os.close(its_end)
    try:

        def sandbox_up() -> bool:
            with contextlib.suppress(OSError):
                while select.select([terminal], [], [], 0)[0]:  # read what it says, so its writes never block
                    os.read(terminal, 65536)
            return len(engine.containers.list(filters={"label": label})) == 2

        wait_for(sandbox_up, "the agent and its gate")
        os.close(terminal)  # the terminal goes away
        run.send_signal(signal.SIGHUP)
        assert run.wait(timeout=120) == 129
    finally:
        run.kill()
    assert episodes_in(database) == [("cancelled", "the run was interrupted")]
    assert not engine.containers.list(all=True, filters={"label": label})


@pytest.mark.parametrize(
    ("given", "said"),
    [("oops", "--label 'oops': expected KEY=VALUE"), ("trajproxy.run.pid=1", "are trajproxy's own")],
)
def test_a_malformed_label_is_a_one_line_error(given: str, said: str) -> None:
    done = subprocess.run(
        [*RUN, str(EXAMPLE / "tasks.jsonl"), "--agent", "minimal", "--label", given],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("trajproxy run: --label") and said in line, line


def planted(engine: Any, label: str) -> dict[str, Any]:
    """A container (labelled `label`) of each kind of run: one that crashed, one live (this test process plays it),
    one of another owner, one of another host."""
    crashed = exited_run()
    runs = {
        "crashed": crashed,
        "live": RunIdentity.current(),
        "other owner": replace(crashed, owner=str(os.getuid() + 1)),
        "other host": replace(crashed, host="elsewhere.example"),
    }
    key, _, value = label.partition("=")
    made = {
        name: engine.containers.run(
            SANDBOX_IMAGE, ["sleep", "300"], detach=True, labels={MANAGED: "1", key: value, **run.labels()}
        )
        for name, run in runs.items()
    }
    return made


def only_the_crashed_one_is_gone(made: dict[str, Any]) -> None:
    with pytest.raises(Exception, match=r"404|No such container"):
        made["crashed"].reload()
    for name in ("live", "other owner", "other host"):
        made[name].reload()
        assert made[name].status == "running", name


@pytest.mark.serial
def test_sandbox_prune_removes_a_crashed_runs_containers_and_nothing_else(engine: Any, label: str) -> None:
    """Pruning runs on an engine others use: it removes the containers of this owner's runs that are gone, never
    a live run's (this test process plays one), another owner's or another host's."""
    made = planted(engine, label)
    done = subprocess.run([TRAJPROXY, "sandbox", "prune"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    removed, _, left = done.stderr.partition("\n")
    assert removed.startswith("removed ") and made["crashed"].id[:12] in removed, done.stderr
    assert f"of a live run (pid {os.getpid()})" in left, done.stderr
    assert f"of another owner (uid {os.getuid() + 1})" in left, done.stderr
    assert "made on another host (elsewhere.example)" in left, done.stderr
    only_the_crashed_one_is_gone(made)


@pytest.mark.serial
def test_a_run_first_removes_what_runs_now_gone_left_on_its_engine(engine: Any, label: str, tmp_path: Path) -> None:
    """Leaked sandboxes do not pile up: any later `trajproxy run` prunes as `sandbox prune` does, before its tasks."""
    made = planted(engine, label)
    missing = {"prompt": "-", "metadata": {"image": "localhost:1/trajproxy-test/missing:never"}}
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(missing) + "\n")
    done = subprocess.run(
        [*RUN, str(tasks), "--agent-cmd", "true", *into(tmp_path / "db"), "--label", label],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr  # its one task could not run
    said = done.stdout + done.stderr
    assert re.search(r"removed [1-9]\d* container\(s\) left by trajproxy runs that are gone", said), said
    only_the_crashed_one_is_gone(made)
