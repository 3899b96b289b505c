"""The log filter that keeps episode keys and secret headers out of every line a server writes.

Agents may carry their episode key in the URL (`/e/<key>/v1`), so no path may reach a log line whole. Access logs
are off, and the handshake lines uvicorn's WebSocket code writes (with the path) go through KeyRedactor."""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import unquote_plus

_KEY_IN_PATH = re.compile(r"/e/[^/\s\"']+")


# A query's `name=value` pairs, each after a `?` or `&` (or at the start of a string): the value runs to the next `&`
_QUERY_PAIR = re.compile(r"(?:(?<=[?&])|^)([^?&=\s\"'#]+)=([^&\s\"'#]*)")
_SECRET_PARAMS = frozenset({"key"})  # the Gemini API's ?key=, as the server reads the name (agent.py's Gemini)


# What uvicorn says of each upgrade request it leaves to the app (which answers it): noise, and with ws="none"
# its advice to install a WebSocket library is wrong for us.
_UPGRADE_NOISE = ("Unsupported upgrade request.", "No supported WebSocket library detected")


# The websockets library, at debug level, writes each handshake header as a line of its own: these carry secrets.
_HEADER_LINES = ("< %s: %s", "> %s: %s")


_SECRET_HEADERS = frozenset({"authorization", "x-api-key", "x-goog-api-key", "cookie", "proxy-authorization"})


class KeyRedactor(logging.Filter):
    """Rewrites `/e/<key>` in a record to `/e/<key>` literally (and `?key=<key>` likewise, however the name is
    percent-encoded), hides the values of headers that carry secrets, and drops uvicorn's notes on upgrade requests."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_UPGRADE_NOISE):
            return False
        record.msg = _redact(record.msg)
        if record.msg in _HEADER_LINES and isinstance(record.args, tuple) and len(record.args) == 2:
            name, _ = record.args
            if str(name).lower() in _SECRET_HEADERS:
                record.args = (name, "<redacted>")
        if isinstance(record.args, tuple):  # kept a tuple of the same length: formatters unpack it
            record.args = tuple(_redact(arg) for arg in record.args)
        elif isinstance(record.args, dict):
            record.args = {name: _redact(arg) for name, arg in record.args.items()}
        return True


def _redact(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if "/e/" in value:
        value = _KEY_IN_PATH.sub("/e/<key>", value)
    return _QUERY_PAIR.sub(_redacted_pair, value) if "=" in value else value


def _redacted_pair(pair: re.Match[str]) -> str:
    """A query's pair with its value hidden if its name, decoded as the server decodes it (`%6Bey` is `key`), is one
    that carries a secret; a line is matched by what it means, not by how it is spelled."""
    name = pair.group(1)
    if _decoded(name).strip().lower() in _SECRET_PARAMS:
        return f"{name}=<key>"
    return pair.group(0)


def _decoded(name: str) -> str:
    """A name decoded until it no longer changes: `ke%2579` is no name the server reads as `key`, yet an agent that
    sends its key under it has sent its key, and a line must not show it."""
    for _ in range(8):
        plain = unquote_plus(name)
        if plain == name:
            break
        name = plain
    return name


def install_log_filter(servers: tuple[str, ...] = ("uvicorn", "uvicorn.error", "uvicorn.access")) -> None:
    """Put KeyRedactor on the loggers a server writes to, and on ours (once; calling again is harmless)."""
    for name in (*servers, "trajproxy"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, KeyRedactor) for f in logger.filters):
            logger.addFilter(KeyRedactor())
