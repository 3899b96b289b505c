"""The servers in front of the app (`proxy.servers.front`): what each leaves behind once it stops."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

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
