"""How uvicorn serves trajproxy: its configuration, the `Front` that runs it on sockets already listening, and the
HTTP protocol it runs with: uvicorn's httptools protocol with the bounds it lacks (`Limits`).

uvicorn never timed out a head: a connection that sent nothing, or part of its headers, was kept until its client
closed it, and a header of any size or count was buffered. It caps connections only all together (limit_concurrency,
answered 503 on the trainer's socket too) and only once a request has arrived. So the protocol here closes a
connection on the sandboxes' socket beyond their cap at once, and gives every head `header_timeout_s`,
MAX_HEAD_BYTES and MAX_HEADERS (408 or 431, then the connection closes)."""

from __future__ import annotations

import asyncio
import collections
import functools
import http
import logging
import re
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import httptools
import uvicorn
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.http.edge import error_body
from proxy.servers.limits import MAX_HEAD_BYTES, MAX_HEADERS, NO_LIMITS, Limits
from proxy.servers.redaction import install_log_filter
from proxy.servers.sockets import KEEP_ALIVE_S, LISTEN_BACKLOG, WEBSOCKET
from proxy.servers.stopping import Ending

_log = logging.getLogger("trajproxy")


def release(version: str) -> tuple[int, ...]:
    """A version's release numbers (`0.56.0rc1` -> (0, 56, 0), `1.0.dev3` -> (1, 0)): what a comparison with a
    release needs, whatever suffix a pre-release, a post-release or a local build adds."""
    numbers = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in numbers.group().split(".")) if numbers else ()


# uvicorn 0.55 on: a request's body chunks gathered in a bytearray (`cycle.body`), copied out to bytes for the app
_GATHERS_IN_BYTEARRAY = release(uvicorn.__version__) >= (0, 55)


def uvicorn_config(app: Any, limits: Limits, **overrides: Any) -> Any:
    """The uvicorn configuration trajproxy is served with; `overrides` for log level, shutdown grace and so on."""
    options: dict[str, Any] = {
        "access_log": False,  # paths may carry episode keys (/e/<key>/...)
        **WEBSOCKET,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "timeout_graceful_shutdown": 5,  # parked calls would otherwise hold Ctrl-C for a whole turn timeout
        "backlog": LISTEN_BACKLOG,  # uvicorn listens again on the sockets it is given, with this backlog
        "proxy_headers": False,  # believed only from the proxies the settings name, on both fronts: forwarded.py
        "http": functools.partial(_BoundedProtocol, limits=limits, gauge=_Gauge(limits.sandbox_connections)),
        **overrides,
    }
    config = uvicorn.Config(app, **options)
    install_log_filter()
    return config


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app as its shutdown begins; embedded in a program (no `signals`), without its
    signal handlers: Ctrl-C belongs to the program."""

    def __init__(self, config: Any, on_stopping: Callable[[], None], signals: bool) -> None:
        super().__init__(config)
        self._on_stopping = on_stopping
        self._signals = signals

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if self._signals:
            with super().capture_signals():
                yield
        else:
            yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_stopping()
        await super().shutdown(sockets)


class UvicornFront:
    """Serve `app` on `sockets` with uvicorn: under `run()` until SIGINT or SIGTERM, under `serve()` until `stop()`."""

    def __init__(
        self,
        app: Any,
        sockets: list[socket.socket],
        log_level: str,
        graceful_s: float = 5.0,
        limits: Limits = NO_LIMITS,
    ) -> None:
        self._sockets = sockets
        ending = Ending(app, limits)
        grace = {"timeout_graceful_shutdown": graceful_s}
        config = uvicorn_config(ending, limits, log_level=log_level, lifespan="on", **grace)
        self._server = _Server(config, ending.begin, signals=True)
        self._quiet = _Server(config, ending.begin, signals=False)

    @property
    def started(self) -> bool:
        return bool(self._server.started or self._quiet.started)

    def run(self) -> None:
        self._server.run(sockets=self._sockets)  # re-raises the signal that stopped it, once shut down

    async def serve(self) -> None:
        await self._quiet.serve(sockets=self._sockets)

    def stop(self) -> None:
        self._server.should_exit = self._quiet.should_exit = True


class _Gauge:
    """The connections open on the sandboxes' socket, against their cap: one per server, its protocols share it."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open = 0
        self.refused = 0


class _HeadRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _WritableEvent(asyncio.Event):
    """asyncio's Event, set from the start, its waiters' deque (about 380 bytes) made at its first wait: a
    connection's flow control waits on it only while its client reads too slowly, and a parked call's connection
    holds one for as long as it waits."""

    def __init__(self) -> None:  # not asyncio's: its deque is what this saves
        self._waiters: Any = ()
        self._value = True

    async def wait(self) -> Literal[True]:
        if not self._value and isinstance(self._waiters, tuple):
            self._waiters = collections.deque()
        return await super().wait()


class _BoundedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, bounded: a connection beyond the sandboxes' cap is closed before it is read;
    a head must arrive whole within `header_timeout_s` of its connection opening or of its first byte (else 408),
    in MAX_HEAD_BYTES and MAX_HEADERS (else 431); a refused head closes its connection.

    Its own state is in slots: uvicorn's protocol sets 28 attributes, and an instance's dict shares its keys with its
    class's only up to 30 (CPython 3.11), so six more in the dict made every connection's 1.3 KiB larger."""

    __slots__ = ("_counted", "_gauge", "_head_bytes", "_head_timer", "_header_fields", "_limits", "_reading_head",
                 "_turned_away")  # fmt: skip

    def __init__(self, *args: Any, limits: Limits, gauge: _Gauge, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._gauge = gauge
        self._counted = self._turned_away = self._reading_head = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = self._header_fields = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            if self._gauge.open >= self._gauge.cap:
                self._turn_away(transport)
                return
            self._gauge.open += 1
            self._counted = True
        super().connection_made(transport)
        self.flow._is_writable_event = _WritableEvent()
        self._time_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._turned_away:
            return
        self._uncount()
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's own, but a head refused by a callback below is answered with its own status, not 400
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, _HeadRefused):
                self._refuse(e.__context__.status, e.__context__.message)
                return
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._reading_head:  # still not whole after this chunk: what a head not yet parsed holds is counted too
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"the request's head is over {MAX_HEAD_BYTES} bytes")

    def handle_websocket_upgrade(self) -> None:
        self._uncount()  # the WebSocket protocol takes the connection over (on the sandbox socket: to refuse it)
        self._stop_head_timer()
        super().handle_websocket_upgrade()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_head = True
        self._head_bytes = self._header_fields = 0
        self._time_head()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_fields += 1
        if self._header_fields > MAX_HEADERS:
            raise _HeadRefused(431, f"the request has over {MAX_HEADERS} header fields")
        super().on_header(name, value)

    def on_body(self, body: bytes) -> None:
        # uvicorn's own, but a chunk the app reads alone is handed to it as httptools made it: uvicorn (0.55) appends
        # every chunk to a bytearray and copies that out to bytes for the app, two copies of each byte of a body (an
        # agent's call holds its whole conversation: RESULTS.md section 46). Chunks that arrive before the app reads
        # are gathered as uvicorn gathers them, in a bytearray. Where uvicorn gathers otherwise (before 0.55), its
        # own; `tests/test_fronts.py` holds the one it runs with to this.
        cycle = self.cycle
        if (
            not _GATHERS_IN_BYTEARRAY
            or cycle.response_complete
            or (self.parser.should_upgrade() and self._should_upgrade())
        ):
            super().on_body(body)
            return
        held: bytes | bytearray = cycle.body
        if not held:
            held = body  # the app gets bytes(body): itself
        else:
            if isinstance(held, bytes):
                held = bytearray(held)
            held += body
        cycle.body = held  # type: ignore[assignment]
        if len(held) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._stop_head_timer()
        if len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers) > MAX_HEAD_BYTES:
            raise _HeadRefused(431, f"the request's head is over {MAX_HEAD_BYTES} bytes")
        super().on_headers_complete()

    def _time_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        timeout_s = self._limits.header_timeout_s
        if not self._reading_head or (self.cycle is not None and not self.cycle.response_complete):
            self.transport.close()  # nothing came at all (or a pipelined head stalled behind an answer)
            return
        self._refuse(408, f"the request's head did not arrive whole within {timeout_s:g} s")

    def _refuse(self, status: int, message: str) -> None:
        self._stop_head_timer()
        if self.transport.is_closing():
            return
        body = error_body("invalid_request_error", message)
        head = f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        head += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        self.transport.write(head.encode() + body)
        self.transport.close()

    def _turn_away(self, transport: asyncio.Transport) -> None:
        self._turned_away = True
        transport.close()
        self._gauge.refused += 1
        if self._gauge.refused % 1000 == 1:  # the first, then one line in a thousand: a flood writes no flood of lines
            _log.warning(
                "the sandbox socket holds %d connections, its cap: closing new ones at once (%d so far)",
                self._gauge.open,
                self._gauge.refused,
            )

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self._gauge.open -= 1
