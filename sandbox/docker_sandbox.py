"""DockerSandboxes: sandboxes as Docker containers, over the docker SDK; the one module that imports it.

Each sandbox is two containers. The gate has no network at all (`network_mode: none`); it runs the
relay in `sandbox/gate.py`, listening on its own loopback and forwarding to trajproxy's Unix socket,
which is mounted into it. The agent's container joins the gate's network namespace, so loopback is
all it has and trajproxy is the only thing it can reach. (A Docker `internal` network would not do:
it still lets a container reach every address of the host itself.) The docker SDK blocks, so every
call runs on a worker thread of the sandboxes' own pool: a running agent's exec holds its thread for the
whole run, and on asyncio's shared pool (a few threads per core) that would cap how many agents run at
once and starve whatever else in the process uses it (an embedded trajproxy's reads and token counts).
"""

from __future__ import annotations

import asyncio
import io
import tarfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import docker
import docker.errors

from sandbox.containers import ExecResult, SandboxError, SandboxSpec

MANAGED = "trajproxy.managed"
GATE_SOURCE = (Path(__file__).parent / "gate.py").read_text()
GATE_MOUNT = "/run/trajproxy"
_TIMED_OUT = (124, 137)  # exit codes of `timeout` when it had to stop the command
_EXEC_GRACE_S = 30.0
_MAX_THREADS = 1024  # started only as needed; about one per running agent

T = TypeVar("T")


async def _blocking(threads: ThreadPoolExecutor, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking docker call on the sandboxes' own threads."""
    return await asyncio.get_running_loop().run_in_executor(threads, partial(call, *args, **kwargs))


class DockerSandboxes:
    """Starts sandboxes whose only reachable address is trajproxy, served on a Unix socket.

    `socket_source` is where that socket's directory comes from: a host directory (trajproxy runs on
    the host) or a named volume (trajproxy runs in compose). `proxy_port` is the port agents use on
    their loopback, so their base URL is http://127.0.0.1:<proxy_port>/v1.
    """

    def __init__(
        self,
        socket_source: str,
        socket_name: str = "proxy.sock",
        *,
        gate_image: str = "python:3.11-slim",
        proxy_port: int = 8000,
        labels: dict[str, str] | None = None,
        client: Any = None,
    ) -> None:
        self._socket_source = socket_source
        self._socket_name = socket_name
        self._gate_image = gate_image
        self.proxy_port = proxy_port
        self.labels = {MANAGED: "1", **(labels or {})}  # on every container; prune() removes what carries them
        self._client = client
        self._threads = ThreadPoolExecutor(_MAX_THREADS, thread_name_prefix="trajproxy-docker")

    @property
    def base_url(self) -> str:
        """trajproxy's address as agents in these sandboxes see it."""
        return f"http://127.0.0.1:{self.proxy_port}"

    async def start(self, spec: SandboxSpec) -> DockerSandbox:
        return await _blocking(self._threads, self._start, spec)

    async def prune(self) -> int:
        """Remove every container these sandboxes' labels mark (all of trajproxy's, by default); returns how many."""
        return await _blocking(self._threads, self._prune)

    def _docker(self) -> Any:
        if self._client is None:
            try:
                self._client = docker.from_env()
                self._client.ping()
            except docker.errors.DockerException as e:
                raise SandboxError(f"cannot reach the Docker engine ({e}); is dockerd running?") from e
        return self._client

    def _start(self, spec: SandboxSpec) -> DockerSandbox:
        client = self._docker()
        for image in {spec.image, self._gate_image} if spec.proxy else {spec.image}:
            _ensure_image(client, image)
        labels = {**self.labels, **spec.labels}
        hardening: dict[str, Any] = {"cap_drop": ["ALL"], "security_opt": ["no-new-privileges"], "labels": labels}
        gate = None
        try:
            if spec.proxy:
                gate = client.containers.run(
                    self._gate_image,
                    ["python3", "-c", GATE_SOURCE, f"{GATE_MOUNT}/{self._socket_name}", str(self.proxy_port)],
                    detach=True,
                    network_mode="none",
                    volumes={self._socket_source: {"bind": GATE_MOUNT, "mode": "rw"}},
                    mem_limit=64 * 1024**2,
                    pids_limit=32,
                    **hardening,
                )
            limits = spec.limits
            agent = client.containers.run(
                spec.image,
                ["sleep", "infinity"],
                detach=True,
                init=True,
                network_mode=f"container:{gate.id}" if gate else "none",
                environment=spec.env,
                working_dir=spec.workdir,
                mem_limit=limits.memory_bytes,
                memswap_limit=limits.memory_bytes,
                nano_cpus=int(limits.cpus * 1e9),
                pids_limit=limits.pids,
                **hardening,
            )
        except docker.errors.ImageNotFound as e:
            _remove(gate)
            raise SandboxError(f"image not found: {e.explanation}; build or pull it first") from e
        except docker.errors.DockerException as e:
            _remove(gate)
            raise SandboxError(f"could not start a sandbox from {spec.image!r}: {e}") from e
        return DockerSandbox(agent, gate, spec.workdir, self._threads)

    def _prune(self) -> int:
        selector = [f"{name}={value}" for name, value in self.labels.items()]
        containers = self._docker().containers.list(all=True, filters={"label": selector})
        for container in containers:
            _remove(container)
        return len(containers)


class DockerSandbox:
    def __init__(self, agent: Any, gate: Any, workdir: str, threads: ThreadPoolExecutor) -> None:
        self._agent = agent
        self._gate = gate
        self._workdir = workdir
        self._threads = threads

    @property
    def id(self) -> str:
        return str(self._agent.id)

    async def exec(self, command: str, *, timeout_s: float, env: dict[str, str] | None = None) -> ExecResult:
        """Run `command` with `sh -c`; past `timeout_s` it is killed and the result says it timed out."""
        argv = ["timeout", "-k", "5", f"{timeout_s:g}", "sh", "-c", command]
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s + _EXEC_GRACE_S):
                exit_code, output = await _blocking(
                    self._threads, self._agent.exec_run, argv, workdir=self._workdir, environment=env or {}
                )
        except TimeoutError:
            return ExecResult(exit_code=-1, output="", timed_out=True)
        except docker.errors.DockerException as e:
            raise SandboxError(f"exec in sandbox {self.id[:12]} failed: {e}") from e
        timed_out = exit_code in _TIMED_OUT and time.monotonic() - started >= timeout_s
        return ExecResult(exit_code, output.decode("utf-8", "replace"), timed_out)

    async def upload(self, path: str, content: bytes) -> None:
        target = PurePosixPath(path)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:  # relative to "/": parents are created
            info = tarfile.TarInfo(str(target.relative_to(target.anchor)))
            info.size = len(content)
            info.mtime = int(time.time())
            archive.addfile(info, io.BytesIO(content))
        try:
            await _blocking(self._threads, self._agent.put_archive, "/", buffer.getvalue())
        except docker.errors.DockerException as e:
            raise SandboxError(f"could not upload {path} to sandbox {self.id[:12]}: {e}") from e

    async def download(self, path: str) -> bytes:
        def fetch() -> bytes:
            stream, _ = self._agent.get_archive(path)
            with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as archive:
                member = archive.next()
                extracted = archive.extractfile(member) if member else None
                if extracted is None:
                    raise SandboxError(f"{path} in sandbox {self.id[:12]} is not a file")
                return extracted.read()

        try:
            return await _blocking(self._threads, fetch)
        except docker.errors.DockerException as e:
            raise SandboxError(f"could not download {path} from sandbox {self.id[:12]}: {e}") from e

    async def stop(self) -> None:
        await _blocking(self._threads, _remove, self._agent)
        await _blocking(self._threads, _remove, self._gate)


def _ensure_image(client: Any, image: str) -> None:
    """Use the local image, or pull it; a clear error if neither works (no registry, a typo)."""
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        try:
            client.images.pull(image)
        except docker.errors.DockerException as e:
            raise SandboxError(
                f"image {image!r} not found on this machine and could not be pulled; build it first "
                f"(e.g. docker build -t {image} .) or check its name"
            ) from e


def _remove(container: Any) -> None:
    if container is None:
        return
    try:
        container.remove(force=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:
        if e.status_code != 409:  # 409: a removal is already under way
            raise SandboxError(f"could not remove container {container.id[:12]}: {e}") from e
    except docker.errors.DockerException as e:
        raise SandboxError(f"could not remove container {container.id[:12]}: {e}") from e
