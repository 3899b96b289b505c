"""A second backend of the Sandboxes interface, with no Docker: each sandbox is a temporary folder on this machine, its
commands local subprocesses, so the runner's own logic can be driven in seconds.

An "image" is a folder: its files are the working directory every sandbox of it starts with (`build` registers a
folder as an image). Each command runs with `unshare` in a private mount namespace where the sandbox's own folder is
mounted on /tmp, its working directory /tmp/work: the paths the runner writes (the task file, the diff) are each
sandbox's own. This checkout and its Python stay where they are even when they live under /tmp (a clean clone in
`mktemp -d`): each is bound back into the sandbox's /tmp at its own path. Nothing else is isolated: the network, the
rest of the filesystem and the limits are this machine's (`spec.proxy`, `spec.limits`, `spec.mounts` and
`spec.read_only` are not enforced); it is a test double of the interface, not a sandbox to trust.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from sandbox.backends.interface import ExecResult, SandboxError, SandboxSpec

WORK = "work"  # in a sandbox's folder, its /tmp: its working directory
KILLED = 137


def _host_folders_in_tmp() -> list[str]:
    """The folders directly under /tmp that hold this checkout or its Python, which a sandbox must not hide."""
    wanted = (Path(__file__).resolve().parents[1], Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve())
    return sorted({path.parts[2] for path in wanted if path.parts[:2] == ("/", "tmp") and len(path.parts) > 2})


HOST_IN_TMP = _host_folders_in_tmp()


def _kill(process: asyncio.subprocess.Process) -> None:
    """Kill a command's process group (its own session): the command and all it started."""
    with contextlib.suppress(ProcessLookupError):  # all of it has exited already
        os.killpg(process.pid, signal.SIGKILL)


class LocalSandbox:
    def __init__(self, root: Path, env: Mapping[str, str]) -> None:
        self._root = root
        self._env = dict(env)
        for name in HOST_IN_TMP:  # where the host's folders are bound back in
            (root / name).mkdir(exist_ok=True)
        binds = [f"mount --bind {shlex.quote('/tmp/' + name)} {shlex.quote(str(root / name))}" for name in HOST_IN_TMP]
        self._enter = " && ".join([*binds, f"mount --rbind {shlex.quote(str(root))} /tmp", f"cd /tmp/{WORK}"])

    @property
    def id(self) -> str:
        return self._root.name

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str] | None = None, user: str = ""
    ) -> ExecResult:
        inside = f"{self._enter} && exec sh -c {shlex.quote(command)}"
        process = await asyncio.create_subprocess_exec(
            "unshare",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            inside,
            env={**os.environ, **self._env, **(env or {})},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout stops the command and all it started
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), timeout_s)
        except TimeoutError:
            _kill(process)
            output = await process.stdout.read() if process.stdout else b""
            await process.wait()
            return ExecResult(KILLED, output.decode("utf-8", "replace"), timed_out=True)
        finally:
            if process.returncode is None:  # cancelled (the episode's deadline): as a container's removal would,
                _kill(process)  # stop the command and all it started, and reap it: nothing outlives its episode
                await asyncio.shield(process.wait())
        assert process.returncode is not None
        return ExecResult(process.returncode, output.decode("utf-8", "replace"))

    async def upload(self, path: str, content: bytes) -> None:
        where = self._place(path)
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_bytes(content)

    async def upload_tree(self, path: str, folder: Path) -> None:
        shutil.copytree(folder, self._place(path), dirs_exist_ok=True)

    async def download(self, path: str) -> bytes:
        try:
            return self._place(path).read_bytes()
        except OSError as e:
            raise SandboxError(f"cannot read {path} in sandbox {self.id}: {e.strerror}") from e

    async def stop(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)

    def _place(self, path: str) -> Path:
        """Where a path in the sandbox is on this machine: under /tmp, or relative to the working directory."""
        posix = PurePosixPath(path)
        if not posix.is_absolute():
            return self._root / WORK / posix
        if posix.parts[:2] == ("/", "tmp"):
            return self._root / PurePosixPath(*posix.parts[2:])
        raise SandboxError(f"a local sandbox holds only /tmp and its working directory, not {path}")


class LocalSandboxes:
    """Sandboxes as temporary folders under `root`; agents reach trajproxy at `base_url` (this machine's). `path`,
    put first on each sandbox's PATH, holds the programs its "images" would (a Python, say)."""

    def __init__(
        self, base_url: str, root: Path, images: Mapping[str, Path] | None = None, *, path: Path | None = None
    ) -> None:
        self._base_url = base_url
        self._root = root
        self._env = {"PATH": os.pathsep.join(filter(None, [str(path or ""), os.environ.get("PATH", "")]))}
        self.images: dict[str, Path] = dict(images or {})
        self.started: list[SandboxSpec] = []  # what each start was asked for, in order

    @property
    def base_url(self) -> str:
        return self._base_url

    async def build(self, context: Path, tag: str, timeout_s: float) -> bool:
        if tag in self.images:
            return False
        self.images[tag] = context
        return True

    async def start(self, spec: SandboxSpec) -> LocalSandbox:
        if spec.workdir is not None:
            raise SandboxError(f"a local sandbox works in its own folder: give tasks no workdir, not {spec.workdir}")
        image = self.images.get(spec.image)
        if image is None:
            raise SandboxError(f"image {spec.image} not found: build it, or name one of {sorted(self.images)}")
        self.started.append(spec)
        root = Path(tempfile.mkdtemp(prefix="box-", dir=self._root))
        shutil.copytree(image, root / WORK, symlinks=True)
        return LocalSandbox(root, {**self._env, **spec.env})
