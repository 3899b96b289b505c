"""Where a `trajproxy serve` of a SQLite database is found: a small file beside the database (`<db>-serving.json`:
its process, its URL and the Unix socket its sandboxes' gates reach it by), written while it serves, so that a
`trajproxy run` in the same folder goes through it rather than refusing the database it holds. The file is believed
only while its process lives and the database is held; one that a kill -9 left behind is ignored and replaced."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from proxy.core.errors import StorageError
from proxy.storage.database_lock import database_url


@dataclass(frozen=True, slots=True)
class Serving:
    """A trajproxy serving a database: its process id, its URL for trainers, and its socket for sandboxes."""

    pid: int
    url: str
    socket_path: str


def presence_file(url: str) -> Path | None:
    """The file that says who serves the SQLite database at `url`; None for Postgres or an in-memory database."""
    parsed = database_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(f"{os.path.realpath(parsed.database)}-serving.json")


@contextlib.contextmanager
def announced(url: str, serving: Serving) -> Iterator[None]:
    """Say, for as long as this is entered, that `serving` serves the database at `url` (nothing for Postgres)."""
    path = presence_file(url)
    if path is None:
        yield
        return
    written = path.with_name(f".{path.name}.{os.getpid()}")
    written.write_text(json.dumps({"pid": serving.pid, "url": serving.url, "socket_path": serving.socket_path}))
    written.chmod(0o600)
    written.replace(path)
    try:
        yield
    finally:
        if (found := _read(path)) is not None and found.pid == serving.pid:
            path.unlink(missing_ok=True)


def serving(url: str) -> Serving | None:
    """The live trajproxy that says it serves the database at `url`, if one does."""
    try:
        path = presence_file(url)
    except StorageError:  # not a database URL: nobody serves it
        return None
    found = _read(path) if path is not None else None
    if found is None:
        return None
    try:
        os.kill(found.pid, 0)
    except ProcessLookupError:
        return None  # gone: the file a kill -9 left
    except PermissionError:
        pass  # another user's process, alive
    return found if Path(found.socket_path).is_socket() else None


def _read(path: Path) -> Serving | None:
    try:
        said = json.loads(path.read_text())
        return Serving(int(said["pid"]), str(said["url"]), str(said["socket_path"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
