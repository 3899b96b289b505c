"""How granian serves trajproxy: its Rust HTTP/1.1 and WebSocket protocol layer on the sockets `sockets.listen`
opens (TCP and the sandboxes' Unix socket), one worker on the caller's event loop, graceful shutdown bounded.

granian's embedded server binds one address of its own and, on shutdown, stops waiting for the requests in flight
at once; trajproxy needs both of its sockets on one app and parked calls ended (each cleaned up in its `finally`)
before the store closes. So this runs granian's ASGI worker per socket itself, the lifespan once, and cancels the
requests still in flight after `graceful_s`. The access log is off (paths carry episode keys) and KeyRedactor sits
on granian's loggers. Its WebSocket frames are limited to 16 MiB, and it sends no pings (benchmarks/RESULTS.md,
"A compiled HTTP front").

`Limits` are hyper's and granian's own: a head must arrive whole within `header_timeout_s` (else the connection is
closed; hyper's clock also closes a keep-alive connection idle that long), in MAX_HEAD_BYTES (its read buffer, which
may read up to twice that before it refuses) and 100 fields (its fixed limit), else 431; the sandboxes' socket
accepts at most `sandbox_connections` at once (the rest wait in its accept queue, taking no descriptor).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import socket
from dataclasses import dataclass, field
from typing import Any

from granian._futures import _future_watcher_wrapper, _new_cbscheduler
from granian.asgi import LifespanProtocol, _callback_wrapper
from granian.constants import HTTPModes
from granian.http import HTTP1Settings

from proxy.servers.limits import MAX_HEAD_BYTES, Limits
from proxy.servers.redaction import KeyRedactor, install_log_filter
from proxy.servers.sockets import LISTEN_BACKLOG, WEBSOCKET
from proxy.servers.stopping import Ending

# granian admits at most this many connections at once per worker (its "backpressure": a permit per connection),
# holding the rest in the accept queue: each parked call holds one, and a run parks thousands. The sandboxes' socket
# takes Limits.sandbox_connections instead.
MAX_CONCURRENT_REQUESTS = 1 << 20
_LOGGERS = ("_granian", "granian", "granian.access")
_log = logging.getLogger("trajproxy")


@dataclass
class GranianFront:
    """Serve `app` on `sockets` until `stop()` (or, under `run()`, SIGINT/SIGTERM): a `front.Front`."""

    app: Any
    sockets: list[socket.socket]
    log_level: str = "info"
    graceful_s: float = 5.0  # parked calls would otherwise hold Ctrl-C for a whole turn timeout
    limits: Limits = field(default_factory=Limits)
    started: bool = False
    _stopping: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _in_flight: set[asyncio.Task[Any]] = field(default_factory=set)
    _streams: set[asyncio.Task[Any]] = field(default_factory=set)  # those of _in_flight that are WebSockets
    _ending: Ending | None = None

    def run(self) -> None:
        """Serve on a new event loop until SIGINT or SIGTERM, then shut down within `graceful_s` (and a little)."""

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, self.stop)
            await self.serve()

        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(main())

    def stop(self) -> None:
        """Begin shutting down; safe from any thread."""
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._ending = Ending(self.app, self.limits)
        _quiet_logs(self.log_level)
        lifespan = LifespanProtocol(self.app)
        await lifespan.startup()
        if lifespan.interrupt:
            raise RuntimeError("the application failed to start (its log says why)") from lifespan.exc
        signals = [_native().WorkerSignal() for _ in self.sockets]
        for worker_id, (sock, signal_) in enumerate(zip(self.sockets, signals, strict=True), start=1):
            self._start_worker(worker_id, sock, signal_, lifespan.state)
        self.started = True
        try:
            await self._stopping.wait()
        finally:
            # The app's streams are closed first (1012, service restart), while granian still serves them: a worker
            # told to stop drops its upgraded connections as soon as its last HTTP request ends, which the long
            # polls do at once, and a close frame sent after that never left (the client read 1006).
            # One grace for both waits: a client that never answers its stream's close costs no more than it.
            grace_ends = self._loop.time() + self.graceful_s
            self._ending.begin()
            if self._streams:
                await asyncio.wait(set(self._streams), timeout=self.graceful_s)
            for signal_ in signals:
                signal_.set()  # no new connections; requests in flight go on
            for sock in self.sockets:
                sock.close()  # granian listens on duplicates: the sockets given are closed here, as uvicorn does
            await self._end_in_flight(grace_ends)
            await lifespan.shutdown()
            _log.info("Application shutdown complete.")

    def _start_worker(self, worker_id: int, sock: socket.socket, stop: Any, state: dict[str, Any]) -> None:
        uds = sock.family == socket.AF_UNIX
        sock.listen(LISTEN_BACKLOG)  # again, as uvicorn does: a socket given bound but not yet listening
        native = _native()
        # A duplicate for granian, which closes what it is given when it stops: given the socket's own descriptor, it
        # would close it twice (the second time, whatever socket was since given that number).
        holder = native.SocketHolder(os.dup(sock.fileno()), uds, LISTEN_BACKLOG)
        no_tls: tuple[Any, ...] = (False, None, None, None, "tls1.3", None, [], False)
        worker = native.ASGIWorker(
            worker_id,
            (None, holder),
            None,
            1,  # runtime threads: the protocol work is light; Python is the bottleneck
            512,  # runtime blocking threads (granian's default)
            1,  # blocking threads: ASGI takes exactly one
            30,  # their idle timeout, s
            self.limits.sandbox_connections if uds else MAX_CONCURRENT_REQUESTS,
            HTTPModes.http1,  # as uvicorn: WebSocket upgrades need HTTP/1.1
            HTTP1Settings(
                keep_alive=True,
                header_read_timeout=max(1, round(self.limits.header_timeout_s * 1000)),
                max_buffer_size=MAX_HEAD_BYTES,
            ),
            None,
            bool(WEBSOCKET["ws"]),
            None,  # no static files
            *no_tls,
            (None, None),
        )
        app = self._on_unix_socket if uds else self._tracked
        call = _future_watcher_wrapper(_callback_wrapper(app, {}, state))
        scheduler = _new_cbscheduler(self._loop, call, impl_asyncio=True)
        serve = worker.serve_async_uds if uds else worker.serve_async
        serve(scheduler, self._loop, stop)

    async def _on_unix_socket(self, scope: Any, receive: Any, send: Any) -> None:
        # As uvicorn and the ASGI spec have it: no port, no client address (granian says "0" for both). The app
        # tells the sandboxes' socket, agents only, by its server having no port.
        scope["server"], scope["client"] = (scope["server"][0], None), None
        await self._tracked(scope, receive, send)

    async def _tracked(self, scope: Any, receive: Any, send: Any) -> None:
        # Each request runs in an asyncio task of its own (granian's asyncio task mode): kept, to cancel at shutdown.
        task = asyncio.current_task()
        assert task is not None and self._ending is not None
        self._in_flight.add(task)
        if scope["type"] == "websocket":
            self._streams.add(task)
        try:
            await self._ending(scope, receive, send)
        finally:
            self._in_flight.discard(task)
            self._streams.discard(task)

    async def _end_in_flight(self, grace_ends: float) -> None:
        """Let requests in flight finish until the grace ends, then cancel the rest (parked calls clean up as they
        go)."""
        assert self._loop is not None
        if self._in_flight and (left_s := grace_ends - self._loop.time()) > 0:
            await asyncio.wait(set(self._in_flight), timeout=left_s)
        left = set(self._in_flight)
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=self.graceful_s)


def _loop_factory() -> Any:
    """uvloop's event loop where it is installed (uvicorn[standard] brings it), as uvicorn and granian's CLI choose."""
    try:
        import uvloop  # lazy: optional (uvicorn[standard] brings it), and only `run()` makes a loop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _native() -> Any:
    """granian's Rust extension, looked up by name: its stubs type the worker's arguments differently from what its
    own code passes."""
    return importlib.import_module("granian._granian")


def _quiet_logs(level: str) -> None:
    """granian's own log lines at the level asked for, through the root logger's handlers, keys redacted; its
    access log stays off (it is never configured with a format)."""
    install_log_filter(_LOGGERS)
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(level.upper())
    # The Rust side logs under child loggers (`_granian.<module>`), which a filter on `_granian` does not see.
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, KeyRedactor) for f in handler.filters):
            handler.addFilter(KeyRedactor())
