"""The servers in front of the app (`proxy.servers.front`): what each leaves behind once it stops."""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from proxy.servers.front import front


@pytest.mark.parametrize("server", ["granian", "uvicorn"])
def test_a_front_closes_the_sockets_it_served_on_when_it_stops(server: str) -> None:
    """Stopped, either front has closed the listening socket it was given: an embedded proxy's (and every test
    server's) would otherwise stay open until the garbage collector found it."""
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, str]:
        return {"pong": server}

    listening = socket.create_server(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    served = front(server, app, [listening], log_level="warning", graceful_s=1)
    thread = threading.Thread(target=asyncio.run, args=(served.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not served.started:
        assert thread.is_alive() and time.monotonic() < deadline, f"{server} did not start"
        time.sleep(0.01)
    assert httpx.get(f"http://127.0.0.1:{port}/ping", timeout=10).json() == {"pong": server}
    assert listening.fileno() != -1  # open while it serves

    served.stop()
    thread.join(timeout=15)
    assert not thread.is_alive(), f"{server} did not stop"
    assert listening.fileno() == -1


def test_uvicorn_hands_the_app_each_body_chunk_as_read_not_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body that arrives a chunk at a time reaches the app as the chunks httptools made, each the same object:
    uvicorn's own copies every chunk into a bytearray and out again (an agent's call is its whole conversation).
    Chunks that arrive before the app reads are gathered: a body in a thousand HTTP chunks, sent at once, reads
    whole."""
    from proxy.servers import uvicorn_front

    made: list[bytes] = []
    on_body = uvicorn_front._BoundedProtocol.on_body

    def recorded(self: uvicorn_front._BoundedProtocol, body: bytes) -> None:
        made.append(body)
        on_body(self, body)

    monkeypatch.setattr(uvicorn_front._BoundedProtocol, "on_body", recorded)
    given: list[bytes] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while True:
            message = await receive()
            given.append(message["body"])
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    listening = socket.create_server(("127.0.0.1", 0))
    served = front("uvicorn", app, [listening], log_level="warning", graceful_s=1)
    thread = threading.Thread(target=asyncio.run, args=(served.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not served.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    parts = [bytes([65 + i % 26]) * 16_000 for i in range(12)]
    tiny = [b"%x\r\n%s\r\n" % (len(part), part) for part in (bytes([97 + i % 26]) * 7 for i in range(1000))]
    try:
        with socket.create_connection(listening.getsockname(), timeout=20) as client:
            client.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % sum(map(len, parts)))
            for part, sent in zip(parts, itertools.accumulate(map(len, parts)), strict=True):
                client.sendall(part)
                while sum(map(len, given)) < sent:  # the app has read it all, before the next part goes
                    assert time.monotonic() < deadline + 20, "the app did not read the body"
                    time.sleep(0.005)
            assert client.recv(1024).startswith(b"HTTP/1.1 200")
            alone = [body for body in given if body and any(body is chunk for chunk in made)]
            assert b"".join(given) == b"".join(parts) and len(alone) >= len(parts) // 2
            given.clear()
            client.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + b"".join(tiny))
            client.sendall(b"0\r\n\r\n")
            assert client.recv(1024).startswith(b"HTTP/1.1 200")
    finally:
        served.stop()
        thread.join(timeout=15)
    assert b"".join(given) == b"".join(bytes([97 + i % 26]) * 7 for i in range(1000))
    assert all(type(body) is bytes for body in given)


@pytest.mark.parametrize(
    ("version", "numbers"),
    [
        ("0.55.0", (0, 55, 0)),
        ("0.56.0rc1", (0, 56, 0)),
        ("1.0.dev3", (1, 0)),
        ("0.55.0.post1", (0, 55, 0)),
        ("0.60.1+local", (0, 60, 1)),
        ("unknown", ()),
    ],
)
def test_the_uvicorn_version_is_compared_by_its_release_numbers_whatever_its_suffix(
    version: str, numbers: tuple[int, ...]
) -> None:
    """Which body gathering the front keeps is chosen by uvicorn's version: a pre-release or a local build must not
    stop trajproxy importing (it did, its version read as integers alone)."""
    from proxy.servers.uvicorn_front import release

    assert release(version) == numbers


def test_a_connections_writable_event_waits_while_writing_is_paused_and_holds_no_deque_until_then() -> None:
    """uvicorn's flow control waits on its event only while a client reads too slowly: the event a connection holds
    makes its waiters' deque at its first wait (a parked call's connection is some 380 bytes the smaller)."""
    from proxy.servers.uvicorn_front import _WritableEvent

    async def run() -> None:
        event = _WritableEvent()
        assert event.is_set() and await event.wait() is True and event._waiters == ()
        event.set()
        event.clear()  # paused
        waiter = asyncio.ensure_future(event.wait())
        await asyncio.sleep(0)
        assert not waiter.done() and len(event._waiters) == 1
        event.set()  # resumed
        assert await waiter is True and not event._waiters
        event.clear()
        pending = asyncio.ensure_future(event.wait())
        done, _ = await asyncio.wait({pending}, timeout=0.01)
        assert not done
        pending.cancel()

    asyncio.run(run())
