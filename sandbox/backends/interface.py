"""The Sandbox interface: a narrow view of one episode's container, whatever runs it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


class SandboxError(Exception):
    """A sandbox could not be started, used or stopped; the message says what to do about it."""


class SandboxLost(SandboxError):
    """The machine a sandbox ran on is gone (a cluster node died): its task ran no fault of its own, and runs again
    elsewhere."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Resources one sandbox may use."""

    cpus: float = 1.0
    memory_bytes: int = 2 * 1024**3
    pids: int = 512


SCRATCH_BYTES = 1024**3


@dataclass(frozen=True, slots=True)
class ReadOnlyRoot:
    """A root filesystem the agent cannot write, but for its working directory (holding the image's files there)
    and `scratch`, empty folders of at most `scratch_bytes` each (/tmp, where the agent's HOME is)."""

    scratch: tuple[str, ...] = ("/tmp",)
    scratch_bytes: int = SCRATCH_BYTES


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """What to start: an image, its working directory, and the environment the agent gets."""

    image: str
    workdir: str | None = "/"  # None: the image's own
    env: dict[str, str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    labels: dict[str, str] = field(default_factory=dict)
    proxy: bool = True  # reach trajproxy (and nothing else); False: no network at all
    mounts: dict[str, str] = field(default_factory=dict)  # host folder -> path in the container, read-only
    arch: str | None = None  # the architecture the mounts' programs need (amd64); None: any
    read_only: ReadOnlyRoot | None = None  # None: the root filesystem is writable


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int
    output: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class Sandbox(Protocol):
    """One running sandbox. Commands run through `sh -c` in the working directory, as `user` ("": the image's)."""

    @property
    def id(self) -> str: ...

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str] | None = None, user: str = ""
    ) -> ExecResult: ...

    async def upload(self, path: str, content: bytes) -> None: ...

    async def upload_tree(self, path: str, folder: Path) -> None: ...

    async def download(self, path: str) -> bytes: ...

    async def stop(self) -> None: ...


class SandboxFactory(Protocol):
    async def start(self, spec: SandboxSpec) -> Sandbox: ...


class Sandboxes(SandboxFactory, Protocol):
    """Where a run's sandboxes start: one Docker engine (`DockerSandboxes`), the nodes of a Ray cluster
    (`RaySandboxes`), later a Kubernetes cluster. The runner sees only this."""

    @property
    def base_url(self) -> str:
        """trajproxy's address as agents in these sandboxes see it."""
        ...

    async def build(self, context: Path, tag: str, timeout_s: float) -> bool:
        """Build image `tag` from the folder `context` wherever sandboxes start, unless it is there; True if built."""
        ...


class SandboxCounter(Protocol):
    """Told of each sandbox started and each that failed to start (the metrics of a trajproxy in this process)."""

    def sandbox_started(self) -> None: ...

    def sandbox_failed(self) -> None: ...
