"""The bell: wakes trainers' pulls waiting for turns (of one episode, or of any) when turns may have become pullable."""

from __future__ import annotations

import asyncio


class Bell:
    """Wakes waiting pulls when turns may have become pullable; counts its rings, so a pull that found none can
    tell whether one came while it looked."""

    def __init__(self) -> None:
        self.rings = 0  # how many times it rang: a pull that found nothing sees whether it rang while it looked
        self._waiting: list[tuple[str | None, asyncio.Future[None]]] = []

    def ring(self, episode_id: str) -> None:
        """Turns of this episode ("*": of any) may be pullable."""
        self.rings += 1
        keep: list[tuple[str | None, asyncio.Future[None]]] = []
        for wanted, waiter in self._waiting:
            if episode_id == "*" or wanted is None or wanted == episode_id:
                if not waiter.done():
                    waiter.set_result(None)
            else:
                keep.append((wanted, waiter))
        self._waiting = keep

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def wait(self, episode_id: str | None, timeout_s: float) -> None:
        entry = (episode_id, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            async with asyncio.timeout(timeout_s):
                await entry[1]
        except TimeoutError:
            pass
        finally:
            if entry in self._waiting:
                self._waiting.remove(entry)
