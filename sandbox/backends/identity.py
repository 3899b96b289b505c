"""Which run made a sandbox, as labels on its containers, and whether that run is still alive: what prune trusts.

A Docker engine is shared (other users, other CI runs, other machines with the same DOCKER_HOST), so a
container may be removed only when the run that made it is known to be gone: a run of this owner, on this
host, whose process has exited. A pid alone would not do (pids are reused), so a run is its pid together with
the process's start time, and the boot it started in.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

OWNER = "trajproxy.run.owner"
HOST = "trajproxy.run.host"
PID = "trajproxy.run.pid"
STARTED = "trajproxy.run.started"
BOOT = "trajproxy.run.boot"


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """A process that starts sandboxes: its owner (uid), host name, pid, start time (clock ticks after boot,
    from /proc/<pid>/stat) and boot id; the last two are empty where the system has no /proc."""

    owner: str
    host: str
    pid: int
    started: str
    boot: str

    @classmethod
    def current(cls) -> RunIdentity:
        return cls.of_process(os.getpid())

    @classmethod
    def of_process(cls, pid: int) -> RunIdentity:
        """The identity of a running process of this owner on this host."""
        return cls(str(os.getuid()), socket.gethostname(), pid, _start_time(pid) or "", _boot_id())

    @classmethod
    def from_labels(cls, labels: dict[str, str]) -> RunIdentity | None:
        """The run a container's labels name, or None if they name none (made by an older trajproxy)."""
        try:
            return cls(labels[OWNER], labels[HOST], int(labels[PID]), labels[STARTED], labels[BOOT])
        except (KeyError, ValueError):
            return None

    def labels(self) -> dict[str, str]:
        return {OWNER: self.owner, HOST: self.host, PID: str(self.pid), STARTED: self.started, BOOT: self.boot}

    def alive(self) -> bool:
        """Whether this run's process still runs; only meaningful on the host that made it. A reused pid, a
        zombie or a reboot since means the run is gone."""
        if not Path("/proc/self/stat").exists():  # no /proc (macOS): the pid is all there is to go on
            return _pid_exists(self.pid)
        if self.boot != _boot_id():
            return False
        return _start_time(self.pid) == self.started

    def why_kept(self, here: RunIdentity) -> str | None:
        """Why `here` (the run pruning) must leave a container this run made; None if it may remove it."""
        if self.owner != here.owner:
            return f"of another owner (uid {self.owner})"
        if self.host != here.host:
            return f"made on another host ({self.host})"
        if self.alive():
            return f"of a live run (pid {self.pid})"
        return None


def _start_time(pid: int) -> str | None:
    """When the process started (field 22 of /proc/<pid>/stat); None if it is not running (or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone, or hidden from this owner
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces and parentheses
    return None if fields[0] in ("Z", "X") else fields[19]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process now: the pid was reused
        return False
    return True
