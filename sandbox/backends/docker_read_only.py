"""A read-only root filesystem for a Docker sandbox: which folders stay writable, and how.

The working directory holds the repository the image ships with, so an empty tmpfs over it would hide it. It
becomes an anonymous volume instead: Docker fills a new volume with what the image has at its path (owners and
modes kept) before the container starts, so the agent finds the repository where it was and can change it, while
the rest of the image cannot be written. That copy lives on the engine's disk: the local volume driver has no size
limit, and a tmpfs-backed volume is not filled from the image (Docker unmounts it again after the copy). The
scratch folders (/tmp, where the agent's HOME is, and a task format's own, like Harbor's /logs) start empty, so
they are tmpfs-backed volumes of a fixed size, their pages counted in the container's memory as it writes them.

Volumes, not `--tmpfs`: the engine copies files in (`put_archive`) only into volumes once the root is read-only.
Both kinds are anonymous, and removed with their container.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import PurePosixPath
from typing import Any

from sandbox.backends.interface import ReadOnlyRoot, SandboxError


def read_only_options(root: ReadOnlyRoot, workdir: str) -> dict[str, Any]:
    """The container options for `root`, the working directory `workdir` (as resolved: never None) writable."""
    if PurePosixPath(workdir) == PurePosixPath("/"):
        raise SandboxError("a read-only sandbox needs a working directory other than /: give the task a workdir")
    size = f"size={root.scratch_bytes}"
    scratch = {"Name": "local", "Options": {"type": "tmpfs", "device": "tmpfs", "o": size}}
    mounts = [{"Target": workdir, "Type": "volume", "ReadOnly": False}]
    mounts += [
        {"Target": path, "Type": "volume", "ReadOnly": False, "VolumeOptions": {"DriverConfig": scratch}}
        for path in root.scratch
        if PurePosixPath(path) != PurePosixPath(workdir)
    ]
    return {"read_only": True, "mounts": mounts}


def writable_paths(options: dict[str, Any]) -> tuple[str, ...]:
    """The folders `read_only_options` made writable."""
    return tuple(mount["Target"] for mount in options.get("mounts", ()))


def archive_root(path: PurePosixPath, writable: Iterable[str]) -> PurePosixPath:
    """Where to unpack an archive that makes `path`: the innermost writable folder holding it (the engine writes
    into a read-only container's volumes only), else "/" (a writable root: parents are made as needed)."""
    holding = [PurePosixPath(folder) for folder in writable if path.is_relative_to(folder)]
    return max(holding, key=lambda folder: len(folder.parts), default=PurePosixPath("/"))
