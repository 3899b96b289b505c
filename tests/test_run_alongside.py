"""Two `trajproxy run`s at once on one engine, with a prune in between: a prune never touches a live run's
sandboxes; once one run is killed outright (SIGKILL: no chance to clean up), a prune removes exactly its
containers, and the other run carries on and cleans up after itself."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from testkit.tasks import EXAMPLE

TRAJPROXY = str(Path(sys.executable).parent / "trajproxy")


def _as_at_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a test run in the background has SIGINT ignored


def start(name: str, label: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    command = [TRAJPROXY, "run", str(EXAMPLE / "tasks.jsonl"), "--agent-cmd", "sleep 300", "--port", "0"]
    options = ["--label", label, "--label", f"run={name}", "--database-url", f"sqlite:///{tmp_path}/{name}.db"]
    with (tmp_path / f"{name}.stderr").open("w") as sink:
        return subprocess.Popen(
            [*command, *options], stdout=subprocess.DEVNULL, stderr=sink, preexec_fn=_as_at_a_terminal
        )


def containers(engine: Any, *labels: str) -> set[str]:
    """The ids of the containers with all these labels. Sparse: a container removed between the engine's list and
    an inspect of it (a sandbox whose start failed, say) would otherwise fail the listing."""
    listed = engine.containers.list(all=True, filters={"label": list(labels)}, sparse=True)
    return {container.id for container in listed}


def prune(label: str) -> str:
    done = subprocess.run(
        [TRAJPROXY, "sandbox", "prune", "--label", label], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.mark.serial
@pytest.mark.timeout(300)
def test_two_runs_on_one_engine_and_a_prune_between_them(
    engine: Any, task_image: str, label: str, tmp_path: Path
) -> None:
    runs = {name: start(name, label, tmp_path) for name in ("a", "b")}
    try:
        deadline = time.monotonic() + 120
        while not all(len(containers(engine, label, f"run={name}")) == 2 for name in runs):  # an agent, its gate
            assert time.monotonic() < deadline, "the runs never started their sandboxes"
            assert all(run.poll() is None for run in runs.values()), (tmp_path / "a.stderr").read_text()
            time.sleep(0.2)
        a, b = containers(engine, label, "run=a"), containers(engine, label, "run=b")

        said = prune(label)
        assert said.startswith("removed 0 container(s)"), said
        for run in runs.values():
            assert f"2 of a live run (pid {run.pid})" in said, said
        assert containers(engine, label) == a | b

        runs["a"].kill()  # as the OOM killer or a lost node would: nothing of it gets to clean up
        runs["a"].wait(timeout=30)
        assert containers(engine, label, "run=a") == a  # left behind
        said = prune(label)
        assert said.startswith("removed 2 container(s)"), said
        assert containers(engine, label) == b
        assert runs["b"].poll() is None  # the live run never noticed

        runs["b"].send_signal(signal.SIGINT)
        assert runs["b"].wait(timeout=120) == 130, (tmp_path / "b.stderr").read_text()
        assert not containers(engine, label)
    finally:
        for run in runs.values():
            run.kill()
