"""What a front bounds beneath the app: connections on the sandboxes' socket, the time and size of a request's head,
and whose forwarded headers it believes (`Limits`); the process's open-files limit they are sized against.

Agents run model-written code: a sandbox that opened connections until the process ran out of file descriptors
cut the trainer off (`/health` and `/api` answered nothing), and one that sent endless headers held memory. So the
sandboxes' socket holds at most `sandbox_connections` at once, never more than half the descriptors the process may
open, and the trainer's TCP socket keeps the rest (benchmarks/RESULTS.md, "Floods on the sandbox socket")."""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass

from proxy.settings import Settings

# A request's line and headers together, at most (an SDK's are a few KiB). granian's bound is hyper's read buffer,
# set to this; uvicorn's front counts to it.
MAX_HEAD_BYTES = 64 * 1024

# Header fields in one request, at most: hyper's own limit, which granian cannot change; uvicorn's front counts to it.
MAX_HEADERS = 100

_UNLIMITED_FILES = 1 << 20  # what an unlimited open-files limit counts as


@dataclass(frozen=True, slots=True)
class Limits:
    sandbox_connections: int = 4096  # open at once on the sandboxes' Unix socket, all sandboxes together
    header_timeout_s: float = 30.0  # a head must arrive whole within this of its connection or of its first byte
    forwarded_allow_ips: str = ""  # proxies whose X-Forwarded-For/-Proto are believed (none: the peer is the client)

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        """The settings' limits, the sandboxes' connections capped at half the open-files limit in force."""
        connections = min(settings.max_sandbox_connections, max(1, open_files_limit() // 2))
        return cls(connections, settings.header_timeout_s, settings.forwarded_allow_ips)


def open_files_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _UNLIMITED_FILES if soft == resource.RLIM_INFINITY else soft


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (often 1024 of 524288): every connection is a
    file descriptor, and thousands of parked calls are thousands of connections. Returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = _UNLIMITED_FILES if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        # a platform that refuses (macOS caps it lower): the limit stays as it was
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return open_files_limit()


NO_LIMITS = Limits()  # the defaults, for a front whose caller names none
