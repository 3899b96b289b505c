"""Stopping a run from outside: Ctrl-C (SIGINT), a batch scheduler or `kill` (SIGTERM) and a closed terminal
(SIGHUP) all stop it the same way, by cancelling it, so that it records its unfinished episodes as cancelled,
removes their containers and shuts its trajproxy down before it exits with the shell's status for the signal.

outcomes = asyncio.run(until_signalled(run(...), on_signal=say))  # Interrupted(signal) once it has cleaned up
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    """The run was stopped by a signal, and has cleaned up."""

    def __init__(self, signum: int) -> None:
        self.signal = signal.Signals(signum)
        super().__init__(f"stopped by {self.signal.name}")

    @property
    def exit_status(self) -> int:
        """What a shell reports for a process the signal ended: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP."""
        return 128 + self.signal.value


async def until_signalled(work: Awaitable[T], on_signal: Callable[[signal.Signals, bool], None]) -> T:
    """Await `work` in the current task. The first stopping signal cancels it, and once it has wound down,
    Interrupted is raised; a later signal only calls `on_signal` (with first=False), then and until the process
    exits, since stopping while the work cleans up would leave containers and open episodes behind. A signal
    ignored when the run started (SIGHUP under nohup, SIGINT in a job a shell started in the background) stays
    ignored."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    heard: list[signal.Signals] = []

    def hear(signum: signal.Signals) -> None:
        heard.append(signum)
        if len(heard) == 1:
            task.cancel()
        on_signal(signum, len(heard) == 1)

    handled = [signum for signum in STOPPING if signal.getsignal(signum) is not signal.SIG_IGN]
    for signum in handled:
        loop.add_signal_handler(signum, hear, signum)
    try:
        return await work
    except asyncio.CancelledError:
        if heard:
            raise Interrupted(heard[0]) from None
        raise
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)
            if heard:  # stopping until the process exits (the loop's end included): never the default action
                signal.signal(signum, lambda number, _frame: on_signal(signal.Signals(number), False))


async def until_stopped() -> None:
    """Wait for a stopping signal under `until_signalled`, and return then, as the normal end of a wait: the way
    `--keep-serving` ends. The cancellation the signal made is taken back, so the work goes on to its end."""
    task = asyncio.current_task()
    assert task is not None
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        task.uncancel()
