"""What the benchmarks share: the two cores, a server started pinned to its core, CPU and percentile figures.

A server (trajproxy, or the fixed model it is compared with) runs pinned to core 0 with `taskset`; the load
generator pins itself to core 1 (`pin_load`), so the two never share a core.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy
from sqlalchemy.engine import make_url

from proxy.storage.engines import engine_url

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout, for testkit/ (not installed)
from testkit.databases import fresh_schema

HOST = "127.0.0.1"
SERVER_CORE, LOAD_CORE = 0, 1 if (os.cpu_count() or 1) > 1 else 0
BIN = Path(sys.executable).parent


def pin_load() -> None:
    """Run this process (the load generator) on its own core."""
    os.sched_setaffinity(0, {LOAD_CORE})


def unpin() -> None:
    """Let this process (and what it starts) run on every core again, whoever pinned it (all.py pins itself)."""
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


def exit_on_sigterm() -> None:
    """Make SIGTERM (`timeout`, a CI runner) exit through the `finally` blocks and context managers, as Ctrl-C does,
    so that the servers and databases a run made are stopped and dropped."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds a process (all its threads) has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raise_open_files(wanted: int) -> int:
    """Raise this process's open-file limit to `wanted` (past its hard limit only with the privilege to);
    returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = max(wanted, soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, max(target, hard)))
    except (ValueError, OSError):  # raising the hard limit needs CAP_SYS_RESOURCE: go as far as it allows
        target = min(target, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def start_pinned(
    command: Sequence[str],
    health_url: str,
    *,
    open_files: int | None = None,
    wrapper: Sequence[str] = (),
    timeout_s: float = 30.0,
    pinned: bool = True,
) -> subprocess.Popen[bytes]:
    """Start a server on the server core (on any core if not `pinned`; under `wrapper`, e.g. a profiler, if given)
    with at least `open_files` file descriptors, and wait until `health_url` answers 200."""
    preexec: Callable[[], object] | None = None
    if open_files is not None:
        preexec = lambda: raise_open_files(open_files)  # noqa: E731 (runs in the child, before exec)
    on_core = ["taskset", "-c", str(SERVER_CORE)] if pinned else []
    started = [*wrapper, *on_core, *command]
    server = subprocess.Popen(started, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=preexec)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            break
        try:
            if httpx.get(health_url, timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.05)
    server.kill()
    server.wait()
    error = server.stderr.read().decode() if server.stderr else ""
    raise RuntimeError(f"{command[0]} did not start: {error}")


def start_server(
    port: int,
    database_url: str,
    profile: str | None = None,
    *,
    flags: Sequence[str] = (),
    open_files: int | None = None,
    pinned: bool = True,
) -> subprocess.Popen[bytes]:
    """`trajproxy serve` on the server core (any core if not `pinned`), with a long lease (no redelivery while a
    benchmark runs)."""
    command = [str(BIN / "trajproxy"), "serve", "--port", str(port), "--database-url", database_url]
    # Loopback, a throwaway database, load clients that speak raw HTTP: the trainer token is left out (its check is
    # one constant-time compare per trainer request; the tests prove it guards every route).
    command += ["--log-level", "warning", "--lease-s", "600", "--no-trainer-token", *flags]
    spy: list[str] = []
    if profile:  # py-spy samples the server (and its writer thread) into a flame graph
        spy = [str(BIN / "py-spy"), "record", "--threads", "--rate", "250", "--format", "raw", "-o", profile, "--"]
    health = f"http://{HOST}:{port}/health"
    return start_pinned(command, health, open_files=open_files, wrapper=spy, pinned=pinned)


def print_table(title: str, columns: Sequence[tuple[str, str, str]], rows: list[dict[str, Any]]) -> None:
    """Rows as a markdown table under a `###` title: a column per (header, key, format)."""
    print(f"\n### {title}\n")
    print("| " + " | ".join(header for header, _, _ in columns) + " |")
    print("|" + "|".join("---:" for _ in columns) + "|")
    for row in rows:
        print("| " + " | ".join(format(row[key], style) for _, key, style in columns) + " |", flush=True)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (q in 0..100, to a tenth); nan if there are no values."""
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=1000)[int(q * 10) - 1]


@contextlib.contextmanager
def fresh_database(url: str | None) -> Iterator[str]:
    """A fresh, empty database for one run: a SQLite file (no `url`), or a scratch schema of the Postgres at
    `url`, dropped afterwards (a SQLite `url`: that file, the caller's)."""
    if url is None:
        with tempfile.TemporaryDirectory() as folder:
            yield f"sqlite:///{folder}/bench.db"
        return
    if url.startswith("sqlite"):
        yield url
        return
    with fresh_schema(url) as scoped:
        yield scoped


@contextlib.contextmanager
def own_database(url: str) -> Iterator[str]:
    """A database of its own on the Postgres server at `url` (not a schema: replicas LISTEN and NOTIFY per
    database), dropped afterwards. Made by the URL's role where it may create databases; else, on this machine's
    server and as root, by the postgres superuser (as .ci/postgres makes the test database), owned by that role."""
    given = make_url(engine_url(url))
    name = f"bench_{secrets.token_hex(6)}"
    admin = sqlalchemy.create_engine(given, isolation_level="AUTOCOMMIT")

    def run(statement: str) -> None:
        try:
            with admin.connect() as conn:
                conn.execute(sqlalchemy.text(statement))
        except sqlalchemy.exc.ProgrammingError as e:
            # the URL's role may not make databases, or may not end another role's backend: DROP … WITH (FORCE)
            # fails on an autovacuum worker that runs on the database, which only a superuser may stop
            refused = ("permission denied", "must be a member of the role")
            if not any(why in str(e) for why in refused) or os.geteuid() != 0:
                raise
            as_postgres = ["runuser", "-u", "postgres", "--", "psql", "-q", "-p", str(given.port or 5432)]
            subprocess.run([*as_postgres, "-v", "ON_ERROR_STOP=1", "-c", statement], check=True, cwd="/")

    try:
        run(f'CREATE DATABASE {name} OWNER "{given.username}"')
        try:
            yield make_url(url).set(database=name).render_as_string(hide_password=False)
        finally:
            run(f"DROP DATABASE {name} WITH (FORCE)")
    finally:
        admin.dispose()
