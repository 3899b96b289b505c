"""A bundle build's container is removed even when its caller dies before removing it (killed while it ran, or
between its end and its removal): it carries the caller's identity, and the next build removes it once that
caller is gone, never one of a live caller's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from sandbox.backends.identity import PID
from sandbox.backends.images import MANAGED, run_container
from tests.conftest import SANDBOX_IMAGE as IMAGE
from tests.test_storage_upgrade import ROOT

BUILD_LABELS = {MANAGED: "1", "trajproxy.role": "bundle-build"}
# A build that outlasts its caller: the test kills the caller, then ends the container itself.
BUILD = f"from sandbox.backends.images import run_container; run_container({IMAGE!r}, ['sleep', '300'], {{}}, 600)"


def build_containers(engine: Any, pid: int) -> list[Any]:
    labels = [f"{name}={value}" for name, value in {**BUILD_LABELS, PID: str(pid)}.items()]
    # sparse: the engine's list as it is, with no inspect of each container after it (one removed in between,
    # by its live caller, would fail the inspect)
    return list(engine.containers.list(all=True, sparse=True, filters={"label": labels}))


def running(containers: list[Any]) -> list[Any]:
    """Those started (listed once created, a container is not running until its caller starts it)."""
    for container in containers:
        container.reload()
    return [container for container in containers if container.status == "running"]


@pytest.mark.timeout(180)
def test_a_build_container_its_caller_left_is_removed_by_the_next_build(engine: Any) -> None:
    caller = subprocess.Popen([sys.executable, "-c", BUILD], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 90
        while not (made := running(build_containers(engine, caller.pid))) and time.monotonic() < deadline:
            assert caller.poll() is None, "the build ended before its container was seen running"
            time.sleep(0.1)
        assert made, "no running build container carries its caller's pid"
        os.kill(caller.pid, signal.SIGKILL)  # while the container runs: its caller never removes it
        caller.wait(timeout=30)
        [left] = made
        left.kill()  # it ends with nobody left to remove it, and stays: exited, not removed
        left.wait(timeout=60)
        left.reload()
        assert left.status == "exited"

        done = run_container(IMAGE, ["sh", "-c", "echo built"], {}, 120)  # the next build, from a live caller

        assert (done.exit_code, done.output.strip()) == (0, "built")
        assert build_containers(engine, caller.pid) == []
        assert build_containers(engine, os.getpid()) == []  # its own removed as it ended
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait(timeout=30)
        for container in build_containers(engine, caller.pid):
            container.remove(force=True)
