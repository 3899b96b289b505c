"""Floods on the sandbox socket: what a sandbox's connections and heads cost trajproxy, and whether the trainer's
door still answers meanwhile (benchmarks/RESULTS.md, "Floods on the sandbox socket").

    python benchmarks/flood.py [--servers uvicorn,granian] [--connections 6000] [--fds 4096] [--quick]
    PYTHONPATH=../before python benchmarks/flood.py     # another checkout, same script and dependencies

For each front, two rounds, each on a fresh `trajproxy serve` whose open-files limit is --fds (soft and hard: it
can raise neither), serving a Unix socket as sandboxes' gates reach it:
- flood: --connections connections each send a call's head (with its episode's key) and one byte of its body, as
  a sandbox did; then the server's descriptors (less those it had before), and whether the trainer's `/health` and
  `GET /api/turns/next?wait=0` are answered on TCP (and in how long) while the flood holds on;
- heads: two connections each send a 64 MiB header value that never ends (the server's resident memory added once
  they are sent); then half as many connections as the flood each send part of a head and nothing more, and how
  many the server still holds --hold-s seconds later (more than the header timeout: 30 s, or
  TRAJPROXY_HEADER_TIMEOUT_S).
Settings reach the server as TRAJPROXY_* variables, which a checkout that lacks them ignores.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import BIN, HOST, exit_on_sigterm, raise_open_files  # noqa: E402

HEAD = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\ncontent-length: 100\r\n\r\n{{"
PARTIAL = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: "
ANSWER_S = 10.0  # the trainer's call is "not answered" past this


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serving(front: str, fds: int, env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[bytes], int, str]]:
    """`trajproxy serve` on `front` with `fds` open files at most, on TCP and a Unix socket: (process, port, socket)."""
    folder = tempfile.mkdtemp(prefix="tpflood")
    port, path = free_port(), f"{folder}/proxy.sock"
    command = [str(BIN / "trajproxy"), "serve", "--port", str(port), "--database-url", f"sqlite:///{folder}/f.db"]
    command += ["--socket-path", path, "--server", front, "--log-level", "error", "--no-trainer-token"]
    limit = (fds, fds)
    server = subprocess.Popen(
        command,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit),
    )
    try:
        deadline = time.monotonic() + 60
        while not answers(f"http://{HOST}:{port}/health", 1.0):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"trajproxy serve --server {front} did not start")
            time.sleep(0.05)
        yield server, port, path
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def answers(url: str, timeout_s: float) -> float | None:
    """Seconds until `url` answered 200, or None if it did not within `timeout_s`."""
    started = time.monotonic()
    try:
        ok = httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return None
    return time.monotonic() - started if ok else None


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled_fds(pid: int) -> int:
    """The process's descriptors once they stop growing (it has accepted what it will), within 30 s."""
    count, deadline = fds_of(pid), time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(1.0)
        count, last = fds_of(pid), count
        if count == last:
            break
    return count


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def opened(path: str, count: int, data: bytes) -> list[socket.socket]:
    """`count` connections to the Unix socket, each having sent `data` (or been closed by the server at once)."""
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(ANSWER_S)
        try:
            sock.connect(path)
            sock.sendall(data)
        except OSError:  # refused, or closed beyond the cap before it was written to
            pass
        socks.append(sock)
    return socks


def flood(front: str, args: argparse.Namespace) -> dict[str, Any]:
    with serving(front, args.fds, {}) as (server, port, path):
        key = httpx.post(f"http://{HOST}:{port}/api/episodes", json={"task": "flood"}, timeout=30).json()["key"]
        before = fds_of(server.pid)
        socks = opened(path, args.connections, HEAD.format(key=key).encode())
        try:
            held = settled_fds(server.pid) - before
            health = answers(f"http://{HOST}:{port}/health", ANSWER_S)
            pull = answers(f"http://{HOST}:{port}/api/turns/next?wait=0", ANSWER_S)
        finally:
            for sock in socks:
                sock.close()
    return {"held": held, "health_s": health, "pull_s": pull}


def heads(front: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {"TRAJPROXY_HEADER_TIMEOUT_S": str(args.header_timeout_s)} if args.header_timeout_s else {}
    with serving(front, args.fds, env) as (server, _port, path):
        before = rss_mib(server.pid)
        big = opened(path, 2, PARTIAL)
        senders = [threading.Thread(target=send_quietly, args=(sock, args.big_mib)) for sock in big]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        time.sleep(0.5)
        added = rss_mib(server.pid) - before
        for sock in big:
            sock.close()
        before = fds_of(server.pid)
        socks = opened(path, args.connections // 2, PARTIAL)
        try:
            time.sleep(1.0)
            at_first = fds_of(server.pid) - before
            time.sleep(args.hold_s)
            later = fds_of(server.pid) - before
        finally:
            for sock in socks:
                sock.close()
    return {"big_added_mib": added, "partial_first": at_first, "partial_later": later}


def send_quietly(sock: socket.socket, mib: int) -> None:
    """Send a header value of `mib` MiB, never ended, as far as the server reads it."""
    chunk = b"a" * 2**20
    with contextlib.suppress(OSError):
        sock.settimeout(60)
        for _ in range(mib):
            sock.sendall(chunk)


def seconds(value: float | None) -> str:
    return "no answer" if value is None else f"{value * 1000:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--servers", default="uvicorn,granian")
    parser.add_argument("--connections", type=int, default=6000, help="the flood's connections")
    parser.add_argument("--fds", type=int, default=4096, help="the server's open-files limit, soft and hard")
    parser.add_argument("--hold-s", type=float, default=40.0, help="how long partial heads are held before counting")
    parser.add_argument("--header-timeout-s", type=float, help="TRAJPROXY_HEADER_TIMEOUT_S for the partial heads")
    parser.add_argument("--big-mib", type=int, default=64, help="each big head's header value, MiB")
    parser.add_argument("--repeats", type=int, default=1, help="(all.py's; each round runs once)")
    parser.add_argument("--quick", action="store_true", help="a smoke: 300 connections, 256 files, 1 s timeout")
    args = parser.parse_args()
    if args.quick:
        args.connections, args.fds, args.hold_s, args.header_timeout_s, args.big_mib = 300, 256, 3.0, 1.0, 8
    exit_on_sigterm()
    raise_open_files(args.connections + 1024)
    print("\n### Floods on the sandbox socket\n")
    print(f"{args.connections} connections against a server with {args.fds} open files at most; partial heads: ")
    print(f"{args.connections // 2} connections, counted {args.hold_s:g} s on; big heads: 2 x {args.big_mib} MiB.\n")
    print(
        "| front | flood: connections held | /health | /api/turns/next | partial heads held: at 1 s | "
        f"at {args.hold_s:g} s | big heads: memory added |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    failed = False
    for front in args.servers.split(","):
        row = {**flood(front, args), **heads(front, args)}
        failed |= row["health_s"] is None or row["pull_s"] is None
        print(
            f"| {front} | {row['held']} | {seconds(row['health_s'])} | {seconds(row['pull_s'])} "
            f"| {row['partial_first']} | {row['partial_later']} | {row['big_added_mib']:.0f} MiB |",
            flush=True,
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
