"""What the replica benchmarks share: N `trajproxy serve --shared` processes on one Postgres database, HAProxy in
front of them (Debian's package, with the compose profile's settings from deploy/haproxy/defaults.cfg), and the
CPU every process of the set used, Postgres's backends included.

Nothing is pinned: on a 2-core machine the replicas, the balancer, Postgres and the load generator share both cores,
which is why the figures are given per core used.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import sqlalchemy
from harness import HOST, cpu_seconds, start_server
from soak_ledger import Complaints
from sqlalchemy.engine import make_url

from proxy.storage.engines import engine_url

DEFAULTS_CFG = Path(__file__).resolve().parent.parent / "deploy" / "haproxy" / "defaults.cfg"
SHARED = "--shared"  # the queue in Postgres, shared by the replicas: every replica's flag


class NoBalancer(RuntimeError):
    """HAProxy is not installed here."""


class Replica:
    """One `trajproxy serve --shared` process, which can be killed -9 and started again on its port."""

    def __init__(self, port: int, database_url: str, flags: Sequence[str], open_files: int) -> None:
        """On `port`, or with 0 on a free one (picked again if another process takes it first)."""
        self._database_url = database_url
        self._flags = list(flags)
        self._open_files = open_files
        self.complaints = Complaints()  # what it logged at ERROR, over all its lives
        self.port, self.process = on_free_port(port, self._started_on)

    def _started_on(self, port: int) -> subprocess.Popen[bytes]:
        self.port = port
        return self.start()

    def start(self) -> subprocess.Popen[bytes]:
        process = start_server(
            self.port, self._database_url, flags=self._flags, open_files=self._open_files, pinned=False
        )
        threading.Thread(target=self.complaints.read, args=(process.stderr,), daemon=True).start()
        self.process = process
        return process

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def haproxy() -> str:
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")
    if found is None:
        raise NoBalancer("haproxy is not installed: apt-get install -y haproxy (Debian's package)")
    return found


@contextlib.contextmanager
def balancer(
    backend_ports: Sequence[int], port: int = 0, timeout_s: float = 30.0
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """HAProxy on `port` (0: a free one) in front of the replicas on `backend_ports`, up once a request through it
    is answered; yields the process and its port."""
    servers = "\n".join(f"    server r{p} {HOST}:{p} check" for p in backend_ports)
    with tempfile.TemporaryDirectory() as folder:

        def start(port: int) -> subprocess.Popen[bytes]:
            config = Path(folder) / "balancer.cfg"
            frontend = f"frontend agents\n    bind {HOST}:{port}\n    default_backend replicas\n\n"
            config.write_text(f"{frontend}backend replicas\n{servers}\n")
            command = [haproxy(), "-db", "-f", str(DEFAULTS_CFG), "-f", str(config)]
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                wait_healthy(f"http://{HOST}:{port}/health", process, timeout_s)
            except RuntimeError:
                process.kill()
                process.wait(30)
                raise
            return process

        port, process = on_free_port(port, start)
        try:
            yield process, port
        finally:
            process.terminate()
            process.wait(30)


T = TypeVar("T")


def on_free_port(port: int, start: Callable[[int], T]) -> tuple[int, T]:
    """`start(port)`; with port 0, `start` on a free port, and on another if a process took that one meanwhile (the
    port is free when picked, not necessarily when bound: other tests run on this machine)."""
    for _ in range(5 if port == 0 else 1):
        chosen = port or free_port()
        try:
            return chosen, start(chosen)
        except RuntimeError as e:
            if port or not any(taken in str(e) for taken in ("Address already in use", "cannot bind")):
                raise
    raise RuntimeError("no free port could be bound five times over")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    error = process.stderr.read().decode() if process.poll() is not None and process.stderr else "no answer"
    raise RuntimeError(f"the balancer did not start: {error}")


@contextlib.contextmanager
def replica_set(
    count: int, database_url: str, flags: Sequence[str] = (), open_files: int = 4096, base_port: int = 0
) -> Iterator[list[Replica]]:
    """`count` replicas on ports `base_port`, `base_port` + 1 … (0: free ones), stopped afterwards."""
    replicas: list[Replica] = []
    try:
        for n in range(count):
            replicas.append(Replica(base_port + n if base_port else 0, database_url, flags, open_files))
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


@dataclass(frozen=True)
class Cpu:
    """CPU seconds used so far, by part."""

    replicas_s: float
    balancer_s: float
    postgres_s: float
    load_s: float

    @property
    def total_s(self) -> float:
        return self.replicas_s + self.balancer_s + self.postgres_s + self.load_s

    def __sub__(self, before: Cpu) -> Cpu:
        return Cpu(
            self.replicas_s - before.replicas_s,
            self.balancer_s - before.balancer_s,
            self.postgres_s - before.postgres_s,
            self.load_s - before.load_s,
        )


class CpuMeter:
    """Reads the CPU of the replicas, the balancer, this process (the load) and the Postgres backends serving the
    database. Backends come and go with the replicas' connection pools, so a thread finds them every 0.2 s by their
    process title (`postgres: …: <user> <database> <client> <state>`) and keeps the last CPU figure of each: only a
    backend that lives less than that is missed."""

    def __init__(self, database_url: str, replicas: list[Replica], balancer_pid: int) -> None:
        self._database = f" {make_url(database_url).database} "
        self._replicas = replicas
        self._balancer_pid = balancer_pid
        self._backends: dict[int, float] = {}  # pid -> CPU seconds when last seen
        self._stopped = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stopped.wait(0.2):
            self._find_backends()

    def _find_backends(self) -> None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                title = (entry / "cmdline").read_bytes().decode(errors="replace")
                if title.startswith("postgres: ") and self._database in title:
                    self._backends[int(entry.name)] = cpu_seconds(int(entry.name))

    def read(self) -> Cpu:
        self._find_backends()
        return Cpu(
            sum(_cpu_or_zero(replica.process.pid) for replica in self._replicas),
            _cpu_or_zero(self._balancer_pid),
            sum(self._backends.values()),
            time.process_time(),
        )

    def close(self) -> None:
        self._stopped.set()
        self._sampler.join()


def _cpu_or_zero(pid: int) -> float:
    try:
        return cpu_seconds(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0.0


def machine_busy_s() -> float:
    """Non-idle CPU seconds of the whole machine so far (every process's, ours or not)."""
    fields = [int(n) for n in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def count_turns(database_url: str, condition: str) -> int:
    """How many turns of the database meet the SQL `condition`."""
    engine = sqlalchemy.create_engine(engine_url(database_url))
    try:
        with engine.connect() as conn:
            return int(conn.execute(sqlalchemy.text(f"SELECT count(*) FROM turn WHERE {condition}")).scalar_one())
    finally:
        engine.dispose()
