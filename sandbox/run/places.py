"""Where a `trajproxy run` meets its trajproxy and starts its sandboxes: the trajproxy given (`--proxy-url` with
the socket its sandboxes' gates reach it by) or one started here, and this machine's Docker engine or the nodes of a
Ray cluster (`--ray`). Each takes what it needs, said in a small frozen value, not the command line."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors

from proxy.core.errors import StorageError
from proxy.servers.embedded import CannotListen, embedded_proxy
from proxy.servers.presence import serving
from proxy.storage.database_lock import check_free
from sandbox.backends.docker_sandboxes import DockerSandboxes, prune
from sandbox.backends.gate_containers import GATE_POOL, SOCKET_NAME
from sandbox.backends.interface import SandboxCounter, SandboxError, Sandboxes
from sandbox.backends.ray_sandboxes import ray_sandboxes


class Refused(Exception):
    """What the command line asks for cannot be run; the message says why in one line (exit status 2)."""


@dataclass(frozen=True, slots=True)
class SocketPlace:
    """Where the sandboxes' gates reach trajproxy: the folder or Docker volume to mount, and the socket's name in it."""

    source: str
    name: str = SOCKET_NAME


@dataclass(frozen=True, slots=True)
class GivenProxy:
    """A trajproxy running already (`--proxy-url`): its URL, its trainer token, and its socket for the gates."""

    url: str
    token: str | None
    socket: SocketPlace


@dataclass(frozen=True, slots=True)
class ProxyWanted:
    """Which trajproxy a run uses: the one `given`, else one started here on `database_url` and `port`, its
    database `shared` with the replicas of a Ray cluster's nodes."""

    given: GivenProxy | None
    database_url: str
    port: int
    shared: bool = False


@dataclass(frozen=True, slots=True)
class ProxyPlace:
    """A running trajproxy as the run reaches it: its URL and trainer token, the socket its sandboxes' gates reach
    it by, and (where it runs in this process) what counts the sandboxes started for its metrics."""

    url: str
    token: str | None
    socket: SocketPlace
    counter: SandboxCounter | None = None


@dataclass(frozen=True, slots=True)
class SandboxesWanted:
    """Where a run's sandboxes start: the nodes of the Ray cluster at `ray` (its replicas on `database_url`), else
    this machine's Docker engine, gates kept ready for `concurrency` agents at once and `starts` in all. Every
    container carries `labels`."""

    ray: str | None
    database_url: str
    concurrency: int
    starts: int
    labels: dict[str, str] = field(default_factory=dict)


def socket_place(given: str | None) -> SocketPlace:
    """--socket-source as the sandboxes' gates will use it (the folder or volume to mount, the socket's name in it):
    the socket's path, a folder holding proxy.sock, or a Docker volume holding proxy.sock. Checked here, before any
    sandbox starts: a gate that cannot reach trajproxy only shows as agents failing."""
    if not given:
        raise Refused("--proxy-url needs --socket-source (the path of its --socket-path, or the volume holding it)")
    if "/" not in given:  # a named volume: its socket cannot be seen from here, but the volume can
        try:
            docker.from_env().volumes.get(given)
        except docker.errors.NotFound:
            raise Refused(f"--socket-source {given}: no Docker volume of that name (give a socket's path)") from None
        except docker.errors.DockerException as e:
            raise Refused(f"--socket-source {given}: cannot ask the Docker engine about it ({e})") from None
        return SocketPlace(given)
    path = Path(given).absolute()
    folder = path.is_dir()
    if folder:
        path = path / SOCKET_NAME
    if not path.is_socket():
        found = sorted(p.name for p in path.parent.glob("*") if p.is_socket()) if path.parent.is_dir() else []
        what = f"no socket {SOCKET_NAME} in that folder" if folder else "not a socket"
        there = f" (sockets there: {', '.join(found)})" if found else ""
        raise Refused(f"--socket-source {given}: {what}{there}; give the path of trajproxy's --socket-path")
    return SocketPlace(str(path.parent), path.name)


def proxy_wanted(console: Any, given: GivenProxy | None, database_url: str, port: int, *, shared: bool) -> ProxyWanted:
    """Which trajproxy the run uses, checked before anything is built: the one given; else the `trajproxy serve` that
    serves `database_url` already (the run goes through it); else one started here, once its database and port are
    seen free. Refused says why none can be."""
    if given is not None:
        return ProxyWanted(given, database_url, port, shared=shared)
    try:
        check_free(database_url, shared=shared)
    except StorageError as e:
        if shared or (found := serving(database_url)) is None:
            raise Refused(str(e)) from None
        said = f"{found.url} (pid {found.pid}) serves that database already: this run goes through it"
        console.print(said, markup=False, soft_wrap=True)
        folder, name = os.path.split(found.socket_path)
        return ProxyWanted(GivenProxy(found.url, None, SocketPlace(folder, name)), database_url, port)
    if port:
        try:
            with socket.create_server(("127.0.0.1", port)):
                pass
        except OSError as e:
            raise Refused(
                f"cannot listen on port {port} ({e.strerror}): pass another --port (0: any free one)"
            ) from None
    return ProxyWanted(None, database_url, port, shared=shared)


@contextlib.asynccontextmanager
async def run_sandboxes(console: Any, wanted: SandboxesWanted, proxy: ProxyPlace) -> AsyncIterator[Sandboxes]:
    """Where this run's sandboxes start, reaching `proxy`: the nodes of a Ray cluster, else this machine's Docker
    engine. Either way, containers that runs now gone left on an engine (a crash, a kill -9) are removed first."""
    if wanted.ray:
        try:  # Ray itself loads only once this is entered: an optional extra, that a run without --ray never loads
            async with ray_sandboxes(wanted.ray, wanted.database_url, proxy.token, wanted.labels) as spread:
                slots = sum(node.slots for node in spread.nodes)
                console.print(f"sandboxes on {len(spread.nodes)} Ray node(s), {slots} at once")
                yield spread
        except SandboxError as e:
            raise SystemExit(f"trajproxy run: {e}") from e
        return
    with contextlib.suppress(SandboxError):  # no engine: each task says so
        if removed := (await prune()).removed:
            console.print(f"removed {len(removed)} container(s) left by trajproxy runs that are gone")
    local = DockerSandboxes(
        proxy.socket.source,
        proxy.socket.name,
        labels=wanted.labels,
        counter=proxy.counter,
        gate_pool=min(wanted.concurrency, GATE_POOL),
        pooled_at_most=wanted.starts,
    )
    warming = asyncio.create_task(local.warm())  # the first tasks' gates, started while the run sets up
    try:
        yield local
    finally:
        warming.cancel()
        await asyncio.gather(warming, return_exceptions=True)
        await local.close()


@contextlib.asynccontextmanager
async def run_proxy(wanted: ProxyWanted) -> AsyncIterator[ProxyPlace]:
    """The trajproxy `wanted`: the one given, or one started here for as long as this is entered."""
    if wanted.given is not None:
        yield ProxyPlace(wanted.given.url.rstrip("/"), wanted.given.token, wanted.given.socket)
        return
    try:
        async with embedded_proxy(
            wanted.database_url, wanted.port, **({"shared": True} if wanted.shared else {})
        ) as proxy:
            yield ProxyPlace(proxy.url, proxy.token, SocketPlace(proxy.socket_folder), proxy.metrics)
    except CannotListen as e:
        raise SystemExit(f"trajproxy run: {e}; pass another --port") from e
    except StorageError as e:
        raise SystemExit(f"trajproxy run: {e}") from e
