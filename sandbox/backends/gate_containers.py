"""A sandbox's gate container, as DockerSandboxes starts it: the relay of `gate_relay.py`, waited on until it says
it relays; and a pool of gates started ahead of need, so that a sandbox's start only creates its agent's container."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import docker
import docker.errors

from sandbox.backends.gate_relay import CANNOT_REACH, RELAYING
from sandbox.backends.interface import SandboxError

GATE_SOURCE = (Path(__file__).parent / "gate_relay.py").read_text()
GATE_MOUNT = "/run/trajproxy"
SOCKET_NAME = "proxy.sock"  # trajproxy's socket in its folder, unless given another name
GATE_POOL = 4  # gates a run keeps started ahead of need (on each Ray node too)
GATE_LOG = docker.types.LogConfig(type="json-file", config={"max-size": "1m"})  # readable, whatever the default


def await_relay(gate: Any, timeout_s: float) -> None:
    """Wait until the gate says it relays (a running container is not yet a listening relay: an agent's call
    before that would be refused). Its logs are polled, a little less often as the wait goes on."""
    deadline = time.monotonic() + timeout_s
    pause_s = 0.01
    while RELAYING.encode() not in gate.logs(stdout=True, stderr=False):
        raise_if_exited(gate)
        if time.monotonic() > deadline:
            raise SandboxError(f"the sandbox's gate was not relaying after {timeout_s:g} s; is the engine overloaded?")
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, 0.2)


def gate_complaint(gate: Any) -> str:
    """The gate's last word on failing to reach trajproxy (a line to end a failed command's output), or ""."""
    try:
        logs = gate.logs(stdout=False, stderr=True, tail=20).decode("utf-8", "replace")
    except docker.errors.DockerException:
        return ""
    said = [line for line in logs.splitlines() if CANNOT_REACH in line]
    return f"\n{said[-1]}\n" if said else ""


def raise_if_exited(gate: Any) -> None:
    gate.reload()
    if gate.status not in ("created", "running"):
        said = gate.logs(stdout=True, stderr=True).decode("utf-8", "replace").strip()[-2000:]
        raise SandboxError(f"the sandbox's gate exited ({gate.status}) before it relayed: {said}")


class GatePool:
    """Gates started ahead of need, relaying; shared by the worker threads that take and refill it. `budget`: how
    many it may start in all (the sandboxes still to come, when known), so that none is left idle at a run's end."""

    def __init__(self, size: int, budget: int | None = None) -> None:
        self._size = size
        self._budget = budget
        self._ready: list[Any] = []
        self._starting = 0  # being started now
        self._waiting = 0  # takers waiting for one of those
        self._changed = threading.Condition()

    def take(self, timeout_s: float) -> Any:
        """A ready gate; else, while more are being started than takers wait for, one of those once it relays (sooner
        than a new one would); else None."""
        with self._changed:
            if not self._ready and self._starting > self._waiting:
                self._waiting += 1
                try:
                    self._changed.wait_for(lambda: self._ready or self._starting < self._waiting, timeout_s)
                finally:
                    self._waiting -= 1
            return self._ready.pop() if self._ready else None

    def owed(self) -> bool:
        """Whether one more gate is wanted; if so, it counts as being started from now."""
        with self._changed:
            if len(self._ready) + self._starting >= self._size or self._budget == 0:
                return False
            self._starting += 1
            self._budget = None if self._budget is None else self._budget - 1
            return True

    def add(self, gate: Any) -> bool:
        """Keep a gate now relaying; False if the pool was drained meanwhile (the gate is then the caller's)."""
        with self._changed:
            self._starting -= 1
            self._changed.notify_all()
            if len(self._ready) >= self._size:
                return False
            self._ready.append(gate)
            return True

    def failed(self) -> None:
        with self._changed:
            self._starting -= 1
            self._budget = None if self._budget is None else self._budget + 1
            self._changed.notify_all()

    def drain(self) -> list[Any]:
        """Every ready gate, taken out; the pool wants none more."""
        with self._changed:
            self._size = 0
            ready, self._ready = self._ready, []
            self._changed.notify_all()
            return ready
