"""A served call's body sent as the pieces it was written in, never joined into one copy first.

A continued turn's body is its parent's text (the conversation's messages, or its ids) and a little more, held as
pieces (`proxy/adapters/ids_json.py`'s `Pieces`). Joined before it is sent, each turn would copy the whole
conversation once; aiohttp then joins its headers with the body (on Python before 3.12.9) and copies it again:
two copies of about 400 KB a turn at 100k tokens, and a fresh buffer's pages faulted in for each. Here the pieces are
written as they are: the small ones together (one short join), the large ones each as a view the socket reads from.

Loaded with aiohttp, at a served policy's first call (`proxy/adapters/served_upstream.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp
from aiohttp.abc import AbstractStreamWriter

from proxy.adapters.ids_json import Text

WITH_HEADERS = 4096  # at most this much of the body goes out joined with the headers (aiohttp's one write)
SMALL = 16384  # pieces shorter than this are joined with their neighbours into one write


class PiecesPayload(aiohttp.Payload):
    """A JSON body in pieces: the first few bytes written with the headers, then its large pieces as they are and its
    small ones joined, so that no piece over `SMALL` bytes is copied on the way to the socket."""

    _autoclose = True  # bytes in memory, nothing to close

    def __init__(self, body: Sequence[Text]) -> None:
        super().__init__(writes(body), content_type="application/json")
        self._size = sum(map(len, body))

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._value).decode(encoding, errors)

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"".join(self._value)

    async def write(self, writer: AbstractStreamWriter) -> None:
        for part in self._value:
            await writer.write(part)

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: int | None) -> None:
        left = sum(map(len, self._value)) if content_length is None else content_length
        for part in self._value:
            if left <= 0:
                return
            await writer.write(part if len(part) <= left else memoryview(part)[:left])
            left -= len(part)


def writes(body: Sequence[Text]) -> list[Text]:
    """The body as the writes that send it: up to `WITH_HEADERS` bytes first (aiohttp joins them with the headers),
    then runs of small pieces joined, each large piece alone."""
    out: list[Text] = []
    run: list[Text] = []
    for part in body:
        if not part:
            continue
        if not out and not run and len(part) > WITH_HEADERS:  # the first write: a few bytes, sent with the headers
            view = memoryview(part)
            out.append(view[:WITH_HEADERS])
            part = view[WITH_HEADERS:]
        if len(part) < SMALL:
            run.append(part)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(part)
    if run:
        out.append(b"".join(run))
    return out
