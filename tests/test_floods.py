"""What a sandbox cannot do to trajproxy through its socket (its agent runs model-written code), on both servers:
hold a connection without sending a whole head, trickle a body for ever, send a head of any size or count, open
connections until the trainer's door has no file descriptor left, or take more than its gate's share of them."""

from __future__ import annotations

import contextlib
import os
import resource
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from proxy.client import TrainerClient
from proxy.servers.limits import MAX_HEAD_BYTES, MAX_HEADERS
from sandbox.backends.gate_containers import GATE_SOURCE
from sandbox.backends.gate_relay import MAX_CONNECTIONS, RELAYING
from tests.conftest import LiveServer
from tests.test_cli import Served, clean_env, free_port, trajproxy_script
from tests.test_faults import wait_until

pytestmark = pytest.mark.timeout(120)
sqlite_only = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # beneath the app: one database does

WAIT_S = 20.0  # longer than any limit a test here sets: a connection still open after it was never going to close
Address = tuple[int, Any]  # a socket family and its address


def tcp(server: LiveServer) -> Address:
    url = urlsplit(server.url)
    return socket.AF_INET, (url.hostname, url.port)


def unix(server: LiveServer) -> Address:
    return socket.AF_UNIX, server.settings.socket_path


def connected(where: Address) -> socket.socket:
    sock = socket.socket(where[0], socket.SOCK_STREAM)
    sock.settimeout(WAIT_S)
    sock.connect(where[1])
    return sock


def until_closed(sock: socket.socket) -> bytes:
    """What the server says before it closes the connection (a test fails if it never does)."""
    answer = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@contextlib.contextmanager
def trickling(sock: socket.socket, byte: bytes) -> Iterator[None]:
    """Send `byte` every 0.1 s (a client that keeps each read alive) until the server closes the connection."""
    closed = threading.Event()

    def trickle() -> None:
        with contextlib.suppress(OSError):
            while not closed.wait(0.1):
                sock.sendall(byte)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        closed.set()
        thread.join(timeout=WAIT_S)


@pytest.fixture
def guarded(make_server: Callable[..., LiveServer], socket_dir: str) -> LiveServer:
    return make_server(socket_path=f"{socket_dir}/proxy.sock", header_timeout_s=0.5, body_timeout_s=1.0)


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"


@sqlite_only
@pytest.mark.parametrize("side", [unix, tcp], ids=["sandbox socket", "tcp"])
def test_a_head_that_is_not_whole_in_time_closes_its_connection(guarded: LiveServer, side: Any) -> None:
    with connected(side(guarded)) as silent:  # sends nothing at all
        assert until_closed(silent) == b""
    with connected(side(guarded)) as partial:
        partial.sendall(HEAD)
        answer = until_closed(partial)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:200]
    with connected(side(guarded)) as trickled:  # a header a byte at a time: each read is quick, the head never whole
        trickled.sendall(HEAD + b"x-slow: ")
        with trickling(trickled, b"a"):
            answer = until_closed(trickled)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:200]


@sqlite_only
@pytest.mark.parametrize("side", [unix, tcp], ids=["sandbox socket", "tcp"])
def test_a_body_that_trickles_in_is_answered_408_when_its_time_is_up(guarded: LiveServer, side: Any) -> None:
    with TrainerClient(guarded.url, token=guarded.token) as trainer:
        key = trainer.create_episode(task="t").key
    head = HEAD + f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n".encode()
    with connected(side(guarded)) as sock:
        sock.sendall(head + b"content-length: 100000\r\n\r\n")
        with trickling(sock, b" "):  # a byte every 0.1 s: no read ever waits its 30 s
            answer = until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"did not arrive whole" in answer


def answer_to(where: Address, head: bytes) -> bytes:
    with connected(where) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused while it was still being sent
            sock.sendall(head)
        return until_closed(sock)


def headers(count: int, size: int) -> bytes:
    return b"".join(b"x-h%d: %s\r\n" % (i, b"v" * size) for i in range(count))


@sqlite_only
@pytest.mark.parametrize("side", [unix, tcp], ids=["sandbox socket", "tcp"])
def test_heads_over_the_size_or_count_limit_are_refused_431(guarded: LiveServer, side: Any) -> None:
    where = side(guarded)
    health = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
    assert answer_to(where, health + headers(60, 200) + b"\r\n").startswith(b"HTTP/1.1 200")  # an SDK's, and more
    for too_much in (headers(1, 2**20), headers(1, 2 * MAX_HEAD_BYTES), headers(10_000, 1), headers(MAX_HEADERS, 1)):
        answer = answer_to(where, health + too_much + b"\r\n")
        assert answer.startswith(b"HTTP/1.1 431"), answer[:200]


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


FDS = 256  # the flooded server's open-files limit, soft and hard: it may raise neither


def test_a_flood_on_the_sandbox_socket_leaves_the_trainer_door_answering(tmp_path: Path, socket_dir: str) -> None:
    """400 connections on the sandbox socket, each holding a partial head, against a server that may open 256 files:
    they once took every descriptor, and the trainer's /health and /api answered nothing. Now the socket holds at
    most half of them (the cap's default is larger), and the trainer is answered."""
    port, path = free_port(), f"{socket_dir}/proxy.sock"
    args = ["serve", "--port", str(port), "--database-url", f"sqlite:///{tmp_path}/t.db", "--socket-path", path]
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [trajproxy_script(), *args],
            env=clean_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (FDS, FDS)),
        )
    served = Served(process, log)
    flood: list[socket.socket] = []
    try:
        served.wait_healthy(port)
        before = fds_of(process.pid)
        for _ in range(400):
            flood.append(connected((socket.AF_UNIX, path)))
            with contextlib.suppress(OSError):  # closed at once, beyond the cap (uvicorn)
                flood[-1].sendall(HEAD)
        wait_until(lambda: fds_of(process.pid) >= before + FDS // 2 - 8, WAIT_S)  # the flood has its share
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=WAIT_S).status_code == 200, served.output()
        with TrainerClient(f"http://127.0.0.1:{port}", timeout_s=WAIT_S) as trainer:
            assert trainer.next_turns(max=1, wait_s=0) == []
            trainer.create_episode(task="t")
        assert fds_of(process.pid) <= before + FDS // 2 + 16, served.output()
    finally:
        for sock in flood:
            sock.close()
        served.stop()


def closed_by_peer(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""


def test_a_gate_relays_at_most_its_cap_and_closes_the_connections_beyond_it(socket_dir: str) -> None:
    """One sandbox opened 3,302 connections through its gate; the gate now relays MAX_CONNECTIONS at once, closes
    any beyond them unread, and relays again once one ends."""
    path = f"{socket_dir}/proxy.sock"
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # trajproxy's socket, as the gate sees it
    upstream.bind(path)
    upstream.listen(4096)
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                accepted.append(upstream.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    port = free_port()
    relay = subprocess.Popen([sys.executable, "-c", GATE_SOURCE, path, str(port)], stdout=subprocess.PIPE)
    gate = (socket.AF_INET, ("127.0.0.1", port))
    clients: list[socket.socket] = []
    try:
        assert relay.stdout is not None and RELAYING in relay.stdout.readline().decode()
        clients += [connected(gate) for _ in range(MAX_CONNECTIONS)]
        wait_until(lambda: len(accepted) == MAX_CONNECTIONS, WAIT_S)  # each relayed to trajproxy
        with connected(gate) as beyond:
            assert until_closed(beyond) == b""  # closed by the gate, never relayed
        clients.pop(0).close()

        def one_more_relayed() -> bool:
            """A new connection: relayed once the gate has let the closed one go, closed unread before that."""
            sock = connected(gate)
            wait_until(lambda: len(accepted) > MAX_CONNECTIONS or closed_by_peer(sock), WAIT_S)
            if len(accepted) > MAX_CONNECTIONS:
                clients.append(sock)
                return True
            sock.close()
            return False

        wait_until(one_more_relayed, WAIT_S)
        assert len(accepted) == MAX_CONNECTIONS + 1
    finally:
        relay.kill()
        relay.wait()
        assert relay.stdout is not None
        relay.stdout.close()
        for sock in [*clients, *accepted, upstream]:
            sock.close()
