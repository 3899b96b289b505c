"""The trajproxy a benchmark measures: `trajproxy serve` on a fresh database, from this checkout or another one
(`--before DIR`), and the CPU time its threads have used (from /proc)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from harness import HOST, fresh_database, start_server

from integrations.train.vllm import free_port


@dataclass(frozen=True)
class Server:
    """A trajproxy being measured: where it answers, and its process (None when py-spy runs it)."""

    url: str
    pid: int | None

    def cpu_ns(self) -> tuple[int, int]:
        """The CPU time its main thread and its other threads (the database writer's) have used so far (0 if its
        process is not known)."""
        if self.pid is None:
            return 0, 0
        used = {task.name: int((task / "schedstat").read_text().split()[0]) for task in self.threads.iterdir()}
        main = used.pop(str(self.pid))
        return main, sum(used.values())

    @property
    def threads(self) -> Path:
        return Path(f"/proc/{self.pid}/task")


@contextlib.contextmanager
def trajproxy(database_url: str | None, tree: Path | None, profile: str | None) -> Iterator[Server]:
    """`trajproxy serve` on a fresh database, from this checkout or (`tree`) another one."""
    with fresh_database(database_url) as url:
        port = free_port()
        with pythonpath(tree):
            server = start_server(port, url, profile, pinned=False)
        try:
            yield Server(f"http://{HOST}:{port}", None if profile else server.pid)
        finally:
            server.send_signal(signal.SIGINT)  # py-spy, where it records, writes its profile and stops the server
            server.wait()


@contextlib.contextmanager
def pythonpath(tree: Path | None) -> Iterator[None]:
    """The servers started inside import trajproxy from `tree`, if given (the packages stay this venv's)."""
    if tree is None:
        yield
        return
    was = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tree.resolve())
    try:
        yield
    finally:
        if was is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = was
