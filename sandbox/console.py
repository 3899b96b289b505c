"""How the sandbox side's commands speak: a rich console on standard error that never breaks the command it serves.

`trajproxy run`, `trajproxy agents`, `trajproxy sandbox prune` and `trajproxy tasks make` all print through it; it
sits below every part of the sandbox side, so each may use it."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, TextIO

_UNTERMINAL_WIDTH = 160  # off a terminal (a pipe, a CI log) rich would take 80 columns and fold the table tight


def console() -> Any:
    """Standard error, as wide as its terminal; off one, as wide as a log reads well."""
    from rich.console import Console  # lazy: rich loads only when something is shown, not for `trajproxy --help`

    console = Console(file=_Unbreakable(sys.stderr))  # type: ignore[arg-type]  # a file in all rich uses
    if not console.is_terminal:
        console.width = max(console.width, _UNTERMINAL_WIDTH)
    return console


class _Unbreakable:
    """A stream whose writes never fail: once its terminal has hung up (SIGHUP, then EIO) or its pipe has closed,
    what a run says goes nowhere, and the run goes on cleaning up and exits with its own status."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError):
            return self._stream.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: the stream's own
        return getattr(self._stream, name)
