"""LISTEN on Postgres: one dedicated connection hears the channels replicas notify each other on (shared mode), and
hands each notification to the event loop. If the connection drops it reconnects, then reports an empty channel:
whatever was said meanwhile is lost, so the listener's owner re-reads what it waits on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("trajproxy.storage")

_RECONNECT_S = 0.5


class Listener:
    def __init__(self, url: str, channels: Sequence[str], on_notice: Callable[[str, str], None]) -> None:
        self._url = url  # as psycopg takes it (see `proxy.storage.database_lock.driver_url`)
        self._channels = tuple(channels)
        self._on_notice = on_notice  # (channel, payload); channel "" after a reconnection
        self._conn: psycopg.AsyncConnection[object] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen from now on: notifications committed after this returns are heard."""
        await self._connect()
        self._task = asyncio.create_task(self._run(), name="trajproxy-listener")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._conn is not None:
            import psycopg  # lazy: Postgres's driver, loaded by replicas sharing one (a server on SQLite never is)

            with contextlib.suppress(psycopg.Error):
                await self._conn.close()
            self._conn = None

    async def _connect(self) -> None:
        import psycopg  # lazy: as in `stop`

        conn = await psycopg.AsyncConnection.connect(self._url, autocommit=True)
        for channel in self._channels:
            await conn.execute(f"LISTEN {channel}")  # channel names are ours, never input
        self._conn = conn

    async def _run(self) -> None:
        import psycopg  # lazy: as in `stop`

        while True:
            assert self._conn is not None
            try:
                async for notice in self._conn.notifies():
                    self._on_notice(notice.channel, notice.payload)
            except psycopg.Error as e:
                log.warning("lost the connection that listens for other replicas (%s); reconnecting", type(e).__name__)
            with contextlib.suppress(psycopg.Error):
                await self._conn.close()
            while True:
                await asyncio.sleep(_RECONNECT_S)
                try:
                    await self._connect()
                    break
                except psycopg.Error:
                    continue
            self._on_notice("", "")
