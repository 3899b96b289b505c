"""RaySandboxes: a run's sandboxes spread over the nodes of a Ray cluster (`trajproxy run --ray`), behind the same
interface as one Docker engine's (`sandbox.backends.interface.Sandboxes`), so the runner is the same.

A node offers sandboxes by declaring the custom resource `trajproxy_sandboxes: N` (`ray start --resources
'{"trajproxy_sandboxes": 8}'`): N sandboxes at once. On each such node one actor (`ray_node.SandboxNode`,
pinned there by node affinity) runs a `trajproxy serve --shared` replica on the run's Postgres and starts that node's
sandboxes on its own Docker engine, their gates relaying to that replica's Unix socket. The runner stays in the
`trajproxy run` process: each sandbox is placed on the node with the most free slots, and its commands, uploads and
stop are calls to that node's actor. A node whose actor dies (the node lost, its worker killed) takes its running
sandboxes with it: their calls raise SandboxLost, so the runner records those episodes failed with no reward and
runs their tasks again on the nodes left.

Ray itself is imported only when `ray_sandboxes` is entered (`trajproxy run --ray`): it is an optional extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sandbox.backends.interface import ExecResult, SandboxError, SandboxLost, SandboxSpec
from sandbox.backends.ray_node import SandboxNode, pack

RESOURCE = "trajproxy_sandboxes"
PROXY_PORT = 8000  # the gate's port: agents' base URL is http://127.0.0.1:8000, as on one engine
T = TypeVar("T")


@dataclass(eq=False)
class _Node:
    node_id: str
    actor: Any  # the SandboxNode actor's handle
    slots: int
    used: int = 0
    lost: str = ""  # why it is gone, once it is

    async def call(self, ref: Awaitable[T]) -> T:
        """Await one of its actor's calls; its death is SandboxLost, an error of the call itself the SandboxError."""
        if self.lost:
            raise SandboxLost(self.lost)
        errors = _ray().exceptions
        try:
            return await ref
        except errors.RayTaskError as e:
            if isinstance(e.cause, SandboxError):
                raise SandboxError(str(e.cause)) from None
            raise SandboxError(f"node {self.node_id[:12]}: {e.cause!r}") from None
        except (errors.RayActorError, errors.WorkerCrashedError, errors.NodeDiedError) as e:
            self.lost = self.lost or f"Ray node {self.node_id[:12]} was lost with its sandboxes ({type(e).__name__})"
            raise SandboxLost(self.lost) from None


class RaySandboxes:
    """The sandboxes of a run on a Ray cluster's nodes; make it with `ray_sandboxes`."""

    def __init__(self, nodes: list[_Node]) -> None:
        self.nodes = nodes
        self._free = asyncio.Condition()  # told when a slot is freed or a node lost
        self._builds: dict[str, asyncio.Lock] = {}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{PROXY_PORT}"

    async def start(self, spec: SandboxSpec) -> RaySandbox:
        """Start a sandbox on the node with the most free slots, waiting for one to free when all are taken."""
        node = await self._take_slot()
        starting = asyncio.ensure_future(node.call(node.actor.start.remote(spec)))
        try:
            box_id = await asyncio.shield(starting)
        except asyncio.CancelledError:  # the node goes on starting it: wait for that, then remove it
            with contextlib.suppress(SandboxError):
                await RaySandbox(self, node, await starting).stop()
            raise
        except BaseException:
            await self._release(node)
            raise
        return RaySandbox(self, node, box_id)

    async def build(self, context: Path, tag: str, timeout_s: float) -> bool:
        """Build the image on every live node (any may run the task), unless it is there already."""
        async with self._builds.setdefault(tag, asyncio.Lock()):
            archive = pack(context)
            nodes = [node for node in self.nodes if not node.lost]
            built = await asyncio.gather(
                *(node.call(node.actor.build.remote(archive, tag, timeout_s)) for node in nodes)
            )
            return any(built)

    async def _take_slot(self) -> _Node:
        async with self._free:
            while True:
                live = [node for node in self.nodes if not node.lost]
                if not live:
                    raise SandboxError("no node of the Ray cluster that offered sandboxes is left")
                node = max(live, key=lambda node: node.slots - node.used)
                if node.used < node.slots:
                    node.used += 1
                    return node
                await self._free.wait()

    async def _release(self, node: _Node) -> None:
        async with self._free:
            node.used -= 1
            self._free.notify_all()


class RaySandbox:
    """One sandbox on a node: the Sandbox interface, each call made on the node's actor."""

    def __init__(self, sandboxes: RaySandboxes, node: _Node, box_id: str) -> None:
        self._sandboxes = sandboxes
        self._node = node
        self._id = box_id
        self._stopped = False

    @property
    def id(self) -> str:
        return self._id

    @property
    def node_id(self) -> str:
        return self._node.node_id

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str] | None = None, user: str = ""
    ) -> ExecResult:
        given = dict(env) if env is not None else None
        return await self._lost_frees(self._node.actor.exec.remote(self._id, command, timeout_s, given, user))

    async def upload(self, path: str, content: bytes) -> None:
        await self._lost_frees(self._node.actor.upload.remote(self._id, path, content))

    async def upload_tree(self, path: str, folder: Path) -> None:
        await self._lost_frees(self._node.actor.upload_tree.remote(self._id, path, pack(folder)))

    async def download(self, path: str) -> bytes:
        return await self._lost_frees(self._node.actor.download.remote(self._id, path))

    async def stop(self) -> None:
        """Remove it from its node; on a node that is lost there is nothing left to remove."""
        if self._stopped:
            return
        self._stopped = True
        try:
            await self._node.call(self._node.actor.stop.remote(self._id))
        except SandboxLost:
            pass
        finally:
            await self._sandboxes._release(self._node)

    async def _lost_frees(self, ref: Awaitable[T]) -> T:
        """A call on the node; if the node is lost, the waiting starts are told (one of them raises if none is left)."""
        try:
            return await self._node.call(ref)
        except SandboxLost:
            async with self._sandboxes._free:
                self._sandboxes._free.notify_all()
            raise


@contextlib.asynccontextmanager
async def ray_sandboxes(
    address: str, database_url: str, token: str | None, labels: dict[str, str]
) -> AsyncIterator[RaySandboxes]:
    """Join the Ray cluster at `address` ("auto": the local one's), place a SandboxNode on each node that declares
    `trajproxy_sandboxes`, each pruning its engine's leaked containers, and stop them all at the end."""
    ray = _ray()
    # On a thread: ray.init on the main thread would replace the run's SIGTERM handling with its own (sys.exit).
    await asyncio.to_thread(_connect, address)
    try:
        cluster: list[dict[str, Any]] = ray.nodes()
        offered = [node for node in cluster if node["Alive"] and node["Resources"].get(RESOURCE, 0) >= 1]
        if not offered:
            raise SandboxError(
                f"no node of the Ray cluster at {address} offers sandboxes: start each node's Ray with "
                f"--resources '{{\"{RESOURCE}\": 8}}' (how many sandboxes it runs at once)"
            )
        actor = ray.remote(SandboxNode)
        nodes = []
        for node in offered:
            affinity = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            placed = actor.options(num_cpus=0, max_restarts=0, scheduling_strategy=affinity)
            handle = placed.remote(node["NodeID"], database_url, token, labels)
            nodes.append(_Node(node["NodeID"], handle, int(node["Resources"][RESOURCE])))
        try:
            await asyncio.gather(*(node.call(node.actor.prune.remote()) for node in nodes))
            yield RaySandboxes(nodes)
        finally:
            await asyncio.gather(*(_close(node) for node in nodes))
    finally:
        ray.shutdown()


def _ray() -> Any:
    """The ray module, once Ray is installed; SandboxError, saying how to install it, where it is not.

    Ray's driver would install its native failure-signal handler (Abseil's) for SIGTERM as well, ahead of the run's
    own: on a SIGTERM it dumps a stack trace from inside the signal handler, on whichever thread the signal found,
    and a run stopped that way could then abort (-6 in one run of three here, an OpenSSL assertion while cleaning up)
    instead of exiting 143 with its episodes recorded. Ray reads this once, at its import."""
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        # lazy: Ray is an optional extra (trajproxy[ray]) that takes seconds to import, and only --ray needs it
        import ray
        import ray.util.scheduling_strategies
    except ImportError as e:
        raise SandboxError(f"--ray needs Ray ({e}): pip install 'trajproxy[ray]'") from e
    return ray


def _connect(address: str) -> None:
    ray = _ray()
    logging.getLogger("ray._private.worker").setLevel(logging.ERROR)  # its "SIGTERM handler is not set": as meant
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise SandboxError(f"cannot join the Ray cluster at {address}: {e}") from e


async def _close(node: _Node) -> None:
    with contextlib.suppress(SandboxError):
        await node.call(node.actor.close.remote())
    with contextlib.suppress(Exception):  # gone already
        _ray().kill(node.actor)
