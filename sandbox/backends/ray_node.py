"""One node of a Ray cluster that offers sandboxes: a Ray actor that runs a `trajproxy serve --shared` replica on the
node (a subprocess, on the run's Postgres), with a Unix socket for this node's sandboxes alone, and starts those
sandboxes on the node's own Docker engine (`DockerSandboxes`). `sandbox.backends.ray_sandboxes` places one on each node
that declares the `trajproxy_sandboxes` resource and calls it; nothing else imports this module, so a run without
`--ray` never loads it (nor Ray).

Every container it starts carries `trajproxy.node` (the Ray node's id) besides the usual run labels, which name
this actor's process: when the actor dies, its containers are a gone run's, removed by the next run on that engine.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from sandbox.backends.docker_sandboxes import DockerSandbox, DockerSandboxes
from sandbox.backends.docker_sandboxes import prune as prune_engine
from sandbox.backends.gate_containers import GATE_POOL
from sandbox.backends.interface import ExecResult, SandboxError, SandboxSpec

NODE_LABEL = "trajproxy.node"
_REPLICA_START_S = 60.0
_PR_SET_PDEATHSIG = 1
_SERVE = "from proxy.cli.main import main; main()"


def _die_with_parent() -> None:
    """In the replica's process, before it runs: a SIGTERM when the actor that started it dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class SandboxNode:
    """The actor's body: this node's replica and sandboxes. Its async methods run on the actor's event loop."""

    def __init__(self, node_id: str, database_url: str, token: str | None, labels: dict[str, str]) -> None:
        self.node_id = node_id
        self._folder = tempfile.mkdtemp(prefix="tpray")  # short: Unix socket paths are limited to 108 bytes
        self._log = Path(self._folder) / "replica.log"
        self._replica = self._serve(database_url, token)
        self._sandboxes = DockerSandboxes(self._folder, labels={**labels, NODE_LABEL: node_id}, gate_pool=GATE_POOL)
        self._boxes: dict[str, DockerSandbox] = {}

    def _serve(self, database_url: str, token: str | None) -> subprocess.Popen[bytes]:
        """Start this node's replica and wait until it answers on its socket."""
        socket = f"{self._folder}/proxy.sock"
        command = [sys.executable, "-c", _SERVE, "serve", "--shared", "--port", "0", "--socket-path", socket]
        env = {**os.environ, "TRAJPROXY_DATABASE_URL": database_url}  # never on a command line `ps` shows
        if token is not None:
            env["TRAJPROXY_TRAINER_TOKEN"] = token
        with self._log.open("wb") as log:
            replica = subprocess.Popen(
                [*command, "--log-level", "warning"], stdout=log, stderr=log, env=env, preexec_fn=_die_with_parent
            )
        deadline = time.monotonic() + _REPLICA_START_S
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket), timeout=2) as http:
            while True:
                if replica.poll() is not None:
                    said = self._log.read_text(errors="replace").strip()[-1500:]
                    raise SandboxError(f"node {self.node_id[:12]}: its trajproxy replica exited: {said}")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get("http://replica/health").status_code == 200:
                        return replica
                if time.monotonic() > deadline:
                    replica.kill()
                    raise SandboxError(f"node {self.node_id[:12]}: its trajproxy replica did not start in time")
                time.sleep(0.1)

    def where(self) -> dict[str, Any]:
        """Which node this is, and the pid of the process that owns its sandboxes."""
        return {"node_id": self.node_id, "pid": os.getpid(), "replica_pid": self._replica.pid}

    async def prune(self) -> int:
        """Remove the containers on this node's engine of trajproxy runs that are gone; how many."""
        return len((await prune_engine()).removed)

    async def start(self, spec: SandboxSpec) -> str:
        box = await self._sandboxes.start(spec)
        self._boxes[box.id] = box
        return box.id

    async def exec(
        self, box_id: str, command: str, timeout_s: float, env: dict[str, str] | None, user: str
    ) -> ExecResult:
        return await self._box(box_id).exec(command, timeout_s=timeout_s, env=env, user=user)

    async def upload(self, box_id: str, path: str, content: bytes) -> None:
        await self._box(box_id).upload(path, content)

    async def upload_tree(self, box_id: str, path: str, archive: bytes) -> None:
        """`archive`: the driver's folder as a tar; unpacked here, then copied in as DockerSandbox copies a folder."""
        with tempfile.TemporaryDirectory() as folder:
            unpack(archive, Path(folder))
            await self._box(box_id).upload_tree(path, Path(folder))

    async def download(self, box_id: str, path: str) -> bytes:
        return await self._box(box_id).download(path)

    async def stop(self, box_id: str) -> None:
        box = self._boxes.pop(box_id, None)
        if box is not None:
            await box.stop()

    async def build(self, archive: bytes, tag: str, timeout_s: float) -> bool:
        with tempfile.TemporaryDirectory() as folder:
            unpack(archive, Path(folder))
            return await self._sandboxes.build(Path(folder), tag, timeout_s)

    async def close(self) -> None:
        """Remove this node's sandboxes still there, and stop its replica."""
        for box_id in list(self._boxes):
            with contextlib.suppress(SandboxError):
                await self.stop(box_id)
        await self._sandboxes.close()
        self._replica.terminate()
        try:
            self._replica.wait(15)
        except subprocess.TimeoutExpired:
            self._replica.kill()
        shutil.rmtree(self._folder, ignore_errors=True)

    def _box(self, box_id: str) -> DockerSandbox:
        try:
            return self._boxes[box_id]
        except KeyError:
            raise SandboxError(f"node {self.node_id[:12]} has no sandbox {box_id[:12]} (stopped already)") from None


def pack(folder: Path) -> bytes:
    """A folder as a tar, its paths relative to it, to send to a node."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.add(folder, arcname=".")
    return buffer.getvalue()


def unpack(archive: bytes, folder: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="tar")
