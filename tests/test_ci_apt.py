""".ci/run installs what it needs from Debian as a person would on a shared machine: when another process holds apt's
or dpkg's lock (an unattended upgrade, another run's install), it waits for the lock, up to a bound, instead of
failing at once. Every apt-get of .ci/ goes through .ci/apt-install, which does that."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from testkit.tasks import ROOT

APT_INSTALL = ROOT / ".ci" / "apt-install"
LISTS_LOCK = Path("/var/lib/apt/lists/lock")  # what `apt-get update` takes (its Lock::Timeout does not apply)
FRONTEND_LOCK = Path("/var/lib/dpkg/lock-frontend")  # what `apt-get install` takes

needs_apt = pytest.mark.skipif(
    shutil.which("apt-get") is None or os.geteuid() != 0, reason="Debian's apt-get, as root (as .ci/run runs it)"
)


@contextmanager
def held(lock: Path) -> Iterator[None]:
    """The lock held as apt and dpkg hold theirs (an fcntl write lock on the file), as another process would."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases it


def test_every_apt_get_of_ci_goes_through_apt_install() -> None:
    for script in (ROOT / ".ci").iterdir():
        if script.name == "apt-install" or not script.is_file():  # .ci/trainers holds requirement lists
            continue
        bare = [line for line in script.read_text().splitlines() if re.search(r"\bapt-get\b", line.split("#")[0])]
        assert bare == [], f"{script.name}: use .ci/apt-install, which waits for a held lock: {bare}"
    assert "apt-install" in (ROOT / ".ci" / "run").read_text()


@needs_apt
@pytest.mark.timeout(600)
@pytest.mark.parametrize("lock", [LISTS_LOCK, FRONTEND_LOCK], ids=["lists", "dpkg"])
def test_apt_install_waits_for_a_held_lock_then_installs(lock: Path, tmp_path: Path) -> None:
    stderr = tmp_path / "stderr"
    with held(lock), stderr.open("w") as err:
        # bash is installed already: the install has nothing to do but still takes dpkg's lock
        waiting = subprocess.Popen([str(APT_INSTALL), "bash"], stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            while "waiting for" not in stderr.read_text():  # it says so once, then waits: an event, not a time
                assert waiting.poll() is None, f"it gave up while the lock was held: {stderr.read_text()}"
                time.sleep(0.2)  # polls a file: orders nothing
        except BaseException:
            waiting.kill()
            raise
    assert waiting.wait(timeout=500) == 0, stderr.read_text()  # the lock released: it went on
    said = stderr.read_text()
    assert said.count("waiting for") == 1 and "held by process" in said, said


@needs_apt
def test_a_lock_held_past_the_bound_fails_in_one_line(tmp_path: Path) -> None:
    with held(LISTS_LOCK):
        done = subprocess.run(
            [str(APT_INSTALL), "bash"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "TRAJPROXY_APT_WAIT_S": "1"},
        )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith(".ci/apt-install: apt's lock was still held after 1 s")
