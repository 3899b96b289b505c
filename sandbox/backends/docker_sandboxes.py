"""DockerSandboxes: sandboxes as Docker containers, over the docker SDK (with `sandbox/backends/images.py` and
`sandbox/backends/gate_containers.py`, the only modules that import it).

Each sandbox is two containers. The gate has no network at all (`network_mode: none`); it runs the
relay in `sandbox/backends/gate_relay.py`, listening on its own loopback and forwarding to trajproxy's Unix socket,
which is mounted into it. The agent's container joins the gate's network namespace, so loopback is
all it has and trajproxy is the only thing it can reach. (A Docker `internal` network would not do:
it still lets a container reach every address of the host itself.) The docker SDK blocks, so every
call runs on a worker thread of the sandboxes' own pool: a running agent's exec holds its thread for the
whole run, and on asyncio's shared pool (a few threads per core) that would cap how many agents run at
once and starve whatever else in the process uses it (an embedded trajproxy's reads and token counts).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import tarfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import docker
import docker.errors

from sandbox.backends.docker_read_only import archive_root, read_only_options, writable_paths
from sandbox.backends.gate_containers import (
    GATE_LOG,
    GATE_MOUNT,
    GATE_SOURCE,
    SOCKET_NAME,
    GatePool,
    await_relay,
    gate_complaint,
    raise_if_exited,
)
from sandbox.backends.identity import RunIdentity
from sandbox.backends.images import (
    MANAGED,
    Pruned,
    build_image,
    check_arch,
    ensure_image,
    prune_gone,
    remove_containers,
)
from sandbox.backends.interface import ExecResult, SandboxCounter, SandboxError, SandboxSpec

_TIMED_OUT = (124, 137)  # exit codes of `timeout` when it had to stop the command
_EXEC_GRACE_S = 30.0
_MAX_THREADS = 1024  # started only as needed; about one per running agent

T = TypeVar("T")


async def _blocking(threads: ThreadPoolExecutor, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking docker call on the sandboxes' own threads."""
    return await asyncio.get_running_loop().run_in_executor(threads, partial(call, *args, **kwargs))


async def prune(labels: dict[str, str] | None = None) -> Pruned:
    """Remove the containers of trajproxy's sandboxes (those that also carry `labels`, if given) whose run is gone:
    runs of this owner, on this host, whose process has exited. Those of a live run, another owner or another host
    are left, and said why. No sandboxes need be made for it: a run prunes before it starts any."""
    engine = await asyncio.to_thread(_engine)
    try:
        return await asyncio.to_thread(prune_gone, engine, {**(labels or {}), MANAGED: "1"}, RunIdentity.current())
    finally:
        engine.close()


def _engine() -> Any:
    """This machine's Docker engine, answering; SandboxError if it does not."""
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as e:
        raise SandboxError(f"cannot reach the Docker engine ({e}); is dockerd running?") from e
    return client


class DockerSandboxes:
    """Starts sandboxes whose only reachable address is trajproxy, served on a Unix socket.

    `socket_source` is where that socket's directory comes from: a host directory (trajproxy runs on
    the host) or a named volume (trajproxy runs in compose). `proxy_port` is the port agents use on
    their loopback, so their base URL is http://127.0.0.1:<proxy_port>/v1. Every container carries `labels`,
    and the identity of `run` (by default this process), so that `prune` knows whose it is. With `gate_pool`, that
    many gates are kept relaying ahead of need, so a start only creates the agent's container (`close` ends them);
    `pooled_at_most` caps how many the pool starts in all (the run's sandboxes, when it knows how many).
    """

    def __init__(
        self,
        socket_source: str,
        socket_name: str = SOCKET_NAME,
        *,
        gate_image: str = "python:3.11-slim",
        proxy_port: int = 8000,
        labels: dict[str, str] | None = None,
        run: RunIdentity | None = None,
        gate_timeout_s: float = 60.0,
        client: Any = None,
        counter: SandboxCounter | None = None,
        gate_pool: int = 0,
        pooled_at_most: int | None = None,
    ) -> None:
        self._socket_source = socket_source
        self._socket_name = socket_name
        self._gate_image = gate_image
        self.proxy_port = proxy_port
        self._selector = {**(labels or {}), MANAGED: "1"}  # what prune() looks at
        self.run = run or RunIdentity.current()
        self.labels = {**self._selector, **self.run.labels()}  # on every container these sandboxes start
        self._gate_timeout_s = gate_timeout_s
        self._client = client
        self._counter = counter
        self._threads = ThreadPoolExecutor(_MAX_THREADS, thread_name_prefix="trajproxy-docker")
        self._builds: dict[str, asyncio.Lock] = {}
        self._pool = GatePool(gate_pool, pooled_at_most)
        self._checked: set[tuple[str, str | None, bool]] = set()  # (image, arch, gate too) found there and right

    @property
    def base_url(self) -> str:
        """trajproxy's address as agents in these sandboxes see it."""
        return f"http://127.0.0.1:{self.proxy_port}"

    async def start(self, spec: SandboxSpec) -> DockerSandbox:
        """Start a sandbox; with `spec.proxy`, it is returned once its gate relays, so the agent's first call
        is never refused. Cancelled midway, it removes what it had started before it gives way."""
        starting = asyncio.ensure_future(_blocking(self._threads, self._start, spec))
        try:
            box = await asyncio.shield(starting)
        except SandboxError:
            if self._counter is not None:
                self._counter.sandbox_failed()
            raise
        except asyncio.CancelledError:
            # The docker calls run on a thread that cancelling cannot stop: wait for them, then undo them.
            with contextlib.suppress(SandboxError):
                await (await starting).stop()
            raise
        if self._counter is not None:
            self._counter.sandbox_started()
        return box

    async def warm(self) -> None:
        """Fill the pool of ready gates now."""
        await _blocking(self._threads, self._fill_pool)

    async def close(self) -> None:
        """Remove the pool's gates; started sandboxes are their owners' to stop."""
        await _blocking(self._threads, remove_containers, *self._pool.drain())

    async def build(self, context: Path, tag: str, timeout_s: float) -> bool:
        """Build image `tag` from the folder `context` unless it is there; True when built now. Tasks that share
        an image wait for one build of it."""
        async with self._builds.setdefault(tag, asyncio.Lock()):
            return await _blocking(self._threads, build_image, self._docker(), context, tag, timeout_s)

    async def prune(self) -> Pruned:
        """Remove the containers with these sandboxes' labels whose run is gone (`prune`)."""
        return await _blocking(self._threads, lambda: prune_gone(self._docker(), self._selector, self.run))

    def _docker(self) -> Any:
        if self._client is None:
            self._client = _engine()
        return self._client

    def _start(self, spec: SandboxSpec) -> DockerSandbox:
        client = self._docker()
        checked = (spec.image, spec.arch, spec.proxy)
        if checked not in self._checked:  # once per image: a start makes no inspect it need not
            for image in {spec.image, self._gate_image} if spec.proxy else {spec.image}:
                ensure_image(client, image)
            if spec.arch is not None:
                check_arch(client, spec.image, spec.arch)
            self._checked.add(checked)
        made: list[Any] = []  # every container created, so that a start failing at any later step leaves none
        options: dict[str, Any] = {}
        if spec.read_only is not None:
            workdir = spec.workdir or client.images.get(spec.image).attrs["Config"].get("WorkingDir") or "/"
            options = read_only_options(spec.read_only, workdir)
        try:
            agent, gate = self._create(client, spec, made, options)
        except BaseException:
            remove_containers(*made)
            raise
        return DockerSandbox(agent, gate, spec.workdir, self._threads, writable_paths(options))

    def _create(self, client: Any, spec: SandboxSpec, made: list[Any], options: dict[str, Any]) -> tuple[Any, Any]:
        """The agent's container (with `options`) and its gate (None without `spec.proxy`), started, the gate
        relaying."""
        labels = {**spec.labels, **self.labels}  # a spec's labels never hide whose the container is
        hardening = _hardening(labels)
        gate = None
        try:
            relaying = False
            if spec.proxy:
                gate = self._pool.take(self._gate_timeout_s)
                relaying = gate is not None
                if gate is None:
                    gate = self._new_gate(client, hardening)
                made.append(gate)
                if relaying:  # the pool's owes one: made on a worker thread while this start goes on
                    self._threads.submit(self._fill_pool)
            limits = spec.limits
            agent = client.containers.create(
                spec.image,
                ["sleep", "infinity"],
                init=True,
                network_mode=f"container:{gate.id}" if gate else "none",
                environment=spec.env,
                working_dir=spec.workdir,
                volumes={host: {"bind": path, "mode": "ro"} for host, path in spec.mounts.items()},
                mem_limit=limits.memory_bytes,
                memswap_limit=limits.memory_bytes,
                nano_cpus=int(limits.cpus * 1e9),
                pids_limit=limits.pids,
                **hardening,
                **options,
            )
            made.append(agent)
            try:
                agent.start()
            except docker.errors.APIError:
                if gate is not None:  # a gate that died says why, rather than "cannot join its network"
                    raise_if_exited(gate)
                raise
            if gate is not None and not relaying:  # it had a head start: the agent's container was made meanwhile
                await_relay(gate, self._gate_timeout_s)
        except docker.errors.ImageNotFound as e:
            raise SandboxError(f"image not found: {e.explanation}; build or pull it first") from e
        except docker.errors.DockerException as e:
            raise SandboxError(f"could not start a sandbox from {spec.image!r}: {e}") from e
        return agent, gate

    def _new_gate(self, client: Any, hardening: dict[str, Any]) -> Any:
        """A gate container, started (not yet relaying: see _await_relay)."""
        gate = client.containers.create(
            self._gate_image,
            ["python3", "-c", GATE_SOURCE, f"{GATE_MOUNT}/{self._socket_name}", str(self.proxy_port)],
            network_mode="none",
            volumes={self._socket_source: {"bind": GATE_MOUNT, "mode": "rw"}},
            mem_limit=64 * 1024**2,
            pids_limit=32,
            log_config=GATE_LOG,
            **hardening,
        )
        try:
            gate.start()
        except BaseException:
            remove_containers(gate)
            raise
        return gate

    def _fill_pool(self) -> None:
        """Start gates until the pool holds its size (those being started counted), each added once relaying. A gate
        that fails is left out: a start then makes its own, and says why if it fails too."""
        client = self._docker()
        while self._pool.owed():
            gate = None
            try:
                ensure_image(client, self._gate_image)
                gate = self._new_gate(client, _hardening(self.labels))
                await_relay(gate, self._gate_timeout_s)
            except (SandboxError, docker.errors.DockerException):
                self._pool.failed()
                if gate is not None:
                    with contextlib.suppress(SandboxError):
                        remove_containers(gate)
                return
            if not self._pool.add(gate):  # closed meanwhile
                remove_containers(gate)
                return


class DockerSandbox:
    def __init__(
        self, agent: Any, gate: Any, workdir: str | None, threads: ThreadPoolExecutor, writable: tuple[str, ...] = ()
    ) -> None:
        self._agent = agent
        self._gate = gate
        self._workdir = workdir
        self._threads = threads
        self._writable = writable  # a read-only root's writable folders; empty: all of it

    @property
    def id(self) -> str:
        return str(self._agent.id)

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str] | None = None, user: str = ""
    ) -> ExecResult:
        """Run `command` with `sh -c` as `user` ("": the image's); past `timeout_s` it is killed and the result says
        it timed out."""
        argv = ["timeout", "-k", "5", f"{timeout_s:g}", "sh", "-c", command]
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s + _EXEC_GRACE_S):
                exit_code, output = await _blocking(
                    self._threads,
                    self._agent.exec_run,
                    argv,
                    workdir=self._workdir,
                    environment=dict(env or {}),
                    user=user,
                )
        except TimeoutError:
            return ExecResult(exit_code=-1, output="", timed_out=True)
        except docker.errors.DockerException as e:
            raise SandboxError(f"exec in sandbox {self.id[:12]} failed: {e}") from e
        timed_out = exit_code in _TIMED_OUT and time.monotonic() - started >= timeout_s
        said = output.decode("utf-8", "replace")
        if exit_code != 0 and self._gate is not None:  # what failed may be the way to trajproxy: the gate says so
            said += await _blocking(self._threads, gate_complaint, self._gate)
        return ExecResult(exit_code, said, timed_out)

    async def upload(self, path: str, content: bytes) -> None:
        target = PurePosixPath(path)
        root = archive_root(target, self._writable)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:  # relative to the root: parents are created
            info = tarfile.TarInfo(str(target.relative_to(root)))
            info.size = len(content)
            info.mtime = int(time.time())
            archive.addfile(info, io.BytesIO(content))
        try:
            await _blocking(self._threads, self._agent.put_archive, str(root), buffer.getvalue())
        except docker.errors.DockerException as e:
            raise SandboxError(f"could not upload {path} to sandbox {self.id[:12]}: {e}") from e

    async def upload_tree(self, path: str, folder: Path) -> None:
        """Copy the host folder `folder` to `path` in the sandbox (made if missing), modes kept, owned by root."""
        root = archive_root(PurePosixPath(path), self._writable)
        target = PurePosixPath(path).relative_to(root)
        buffer = io.BytesIO()

        def as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            return info

        with tarfile.open(fileobj=buffer, mode="w") as archive:
            archive.add(folder, arcname=str(target), filter=as_root)
        try:
            await _blocking(self._threads, self._agent.put_archive, str(root), buffer.getvalue())
        except docker.errors.DockerException as e:
            raise SandboxError(f"could not upload {folder} to {path} in sandbox {self.id[:12]}: {e}") from e

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
        await _blocking(self._threads, remove_containers, self._agent, self._gate)


def _hardening(labels: dict[str, str]) -> dict[str, Any]:
    """The options every sandbox container gets: no capabilities, no privilege gained, whose it is."""
    return {"cap_drop": ["ALL"], "security_opt": ["no-new-privileges"], "labels": labels}
