"""A served call's body sent as the pieces it was written in, never joined into one copy first.

A continued turn's body is its parent's text (the conversation's messages, or its ids) and a little more, held as
pieces (`proxy/adapters/ids_json.py`'s `Pieces`). Joined before it is sent, each turn would copy the whole
conversation once; aiohttp then joins its headers with the body (on Python before 3.12.9) and copies it again:
two copies of about 400 KB a turn at 100k tokens, and a fresh buffer's pages faulted in for each. Here the pieces are
written as they are: the small ones together (one short join), the large ones each as a view the socket reads from.

Its aiohttp payload class is made when aiohttp is loaded, at a served policy's first call (`payload`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from proxy.adapters.ids_json import Text

if TYPE_CHECKING:  # aiohttp itself is loaded at a served policy's first call (`_payload_class`)
    import aiohttp

WITH_HEADERS = 4096  # at most this much of the body goes out joined with the headers (aiohttp's one write)
SMALL = 16384  # pieces shorter than this are joined with their neighbours into one write


def payload(body: Sequence[Text]) -> aiohttp.Payload:
    """A JSON body in pieces as aiohttp sends it: the first few bytes written with the headers, then its large pieces
    as they are and its small ones joined, so that no piece over `SMALL` bytes is copied on the way to the socket."""
    return _payload_class()(writes(body), content_type="application/json")


@cache
def _payload_class() -> type[aiohttp.Payload]:
    import aiohttp  # lazy: a server whose policies are the trainer or a hosted model never loads it
    from aiohttp.abc import AbstractStreamWriter  # lazy: with aiohttp

    class PiecesPayload(aiohttp.Payload):
        _autoclose = True  # bytes in memory, nothing to close

        def __init__(self, value: list[Text], *args: Any, **kwargs: Any) -> None:
            super().__init__(value, *args, **kwargs)
            self._size = sum(map(len, value))

        def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
            return b"".join(self._value).decode(encoding, errors)

        async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
            return b"".join(self._value)

        async def write(self, writer: AbstractStreamWriter) -> None:
            await self.write_with_length(writer, None)

        async def write_with_length(self, writer: AbstractStreamWriter, content_length: int | None) -> None:
            left = (self._size or 0) if content_length is None else content_length
            for part in self._value:
                if left <= 0:
                    return
                await writer.write(part if len(part) <= left else memoryview(part)[:left])
                left -= len(part)

    return PiecesPayload


def writes(body: Sequence[Text]) -> list[Text]:
    """The body as the writes that send it: up to `WITH_HEADERS` bytes first (aiohttp joins them with the headers),
    then each large piece alone and the small ones between joined, up to `SMALL` bytes a write."""
    out: list[Text] = []
    run: list[Text] = []
    size = 0
    for part in body:
        if not out and not run and len(part) > WITH_HEADERS:  # the first write: a few bytes, sent with the headers
            view = memoryview(part)
            out.append(view[:WITH_HEADERS])
            part = view[WITH_HEADERS:]
        if not part:
            continue
        if run and size + len(part) > (SMALL if out else WITH_HEADERS):
            out.append(b"".join(run))
            run, size = [], 0
        if len(part) >= SMALL:
            out.append(part)
        else:
            run.append(part)
            size += len(part)
    if run:
        out.append(b"".join(run))
    return out
