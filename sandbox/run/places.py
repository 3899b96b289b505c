"""Where a `trajproxy run` meets its trajproxy and starts its sandboxes: the trajproxy given (`--proxy-url` with
the socket its sandboxes' gates reach it by) or one started here, and this machine's Docker engine or the nodes of a
Ray cluster (`--ray`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import docker
import docker.errors

from proxy.core.errors import StorageError
from proxy.servers.embedded import CannotListen, embedded_proxy
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.backends.gate_containers import GATE_POOL, SOCKET_NAME
from sandbox.backends.interface import SandboxCounter, SandboxError, Sandboxes
from sandbox.backends.ray_sandboxes import ray_sandboxes


class Refused(Exception):
    """What the command line asks for cannot be run; the message says why in one line (exit status 2)."""


def socket_place(given: str | None) -> tuple[str, str]:
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
        return given, SOCKET_NAME
    path = Path(given).absolute()
    folder = path.is_dir()
    if folder:
        path = path / SOCKET_NAME
    if not path.is_socket():
        found = sorted(p.name for p in path.parent.glob("*") if p.is_socket()) if path.parent.is_dir() else []
        what = f"no socket {SOCKET_NAME} in that folder" if folder else "not a socket"
        there = f" (sockets there: {', '.join(found)})" if found else ""
        raise Refused(f"--socket-source {given}: {what}{there}; give the path of trajproxy's --socket-path")
    return str(path.parent), path.name


@contextlib.asynccontextmanager
async def run_sandboxes(
    console: Any,
    args: argparse.Namespace,
    labels: dict[str, str],
    proxy: tuple[str, str, SandboxCounter | None, str | None],
    starts: int,
) -> AsyncIterator[Sandboxes]:
    """Where this run's sandboxes start: the nodes of a Ray cluster (--ray), else this machine's Docker engine, with
    `proxy`'s socket source and name, sandbox counter and trainer token, for about `starts` agents. Either way,
    containers that runs now gone left on an engine (a crash, a kill -9) are removed first."""
    socket_source, socket_name, counter, token = proxy
    if args.ray:
        try:  # Ray itself loads only once this is entered: an optional extra, that a run without --ray never loads
            async with ray_sandboxes(args.ray, args.database_url, token, labels) as spread:
                slots = sum(node.slots for node in spread.nodes)
                console.print(f"sandboxes on {len(spread.nodes)} Ray node(s), {slots} at once")
                yield spread
        except SandboxError as e:
            raise SystemExit(f"trajproxy run: {e}") from e
        return
    with contextlib.suppress(SandboxError):  # no engine: each task says so
        if removed := (await DockerSandboxes("unused").prune()).removed:
            console.print(f"removed {len(removed)} container(s) left by trajproxy runs that are gone")
    pool = min(args.concurrency, GATE_POOL)
    local = DockerSandboxes(
        socket_source, socket_name, labels=labels, counter=counter, gate_pool=pool, pooled_at_most=starts
    )
    warming = asyncio.create_task(local.warm())  # the first tasks' gates, started while the run sets up
    try:
        yield local
    finally:
        warming.cancel()
        await asyncio.gather(warming, return_exceptions=True)
        await local.close()


@contextlib.asynccontextmanager
async def run_proxy(
    args: argparse.Namespace,
) -> AsyncIterator[tuple[str, str | None, str, str, SandboxCounter | None]]:
    """A running trajproxy's URL, trainer token, socket source and name, and (when it runs here) its sandbox counter:
    the one given, or one started here."""
    if args.proxy_url:
        yield args.proxy_url.rstrip("/"), args.trainer_token, args.socket_source, args.socket_name, None
        return
    try:
        async with embedded_proxy(args.database_url, args.port, **({"shared": True} if args.ray else {})) as proxy:
            yield proxy.url, proxy.token, proxy.socket_folder, SOCKET_NAME, proxy.metrics
    except CannotListen as e:
        raise SystemExit(f"trajproxy run: {e}; pass another --port") from e
    except StorageError as e:
        raise SystemExit(f"trajproxy run: {e}") from e
