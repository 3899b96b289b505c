"""A turn's wire body and normalised request as pieces stored once by hash (the `piece` table), and the lists of
piece hashes that put them back together.

An agent's context only grows: each call repeats the system prompt, the tools and the whole history before adding a
little. Stored whole, an episode of n calls holds about n times its final context, twice (wire and request). Cut into
pieces stored by their sha256, the repeated parts are stored once, across turns and across episodes, and a turn keeps
only the hashes of its pieces, written as a difference from the list of a turn before it (`encode_parts`).

- The wire body is cut after an object of a JSON array (a `}` followed by `,{` or `]`: messages, tools, content
  blocks), once a piece holds at least `MIN_PIECE` bytes, and at most `MAX_PIECE` bytes apart; so the message that
  was last in one call is the same piece in the next, and the fields after the array (tools) too. The
  cuts depend only on the bytes, so a body that repeats another's messages repeats its pieces; joined, the pieces are
  the body byte for byte, whatever its dialect or spacing.
- The request is a skeleton (its fields, with `tools` and `messages` left empty), its tool list, and each message,
  every one serialised as the JSON column serialised the request, so it reads back as the same values.

A piece's stored data is its bytes, deflated where that makes them smaller (its first byte says which).
"""

from __future__ import annotations

import hashlib
import re
import zlib
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate
from typing import Any

import orjson

from proxy.core.chunks import Body
from proxy.core.values import JsonObject

MIN_PIECE = 512  # a cut leaves at least this much before it (measured from 64 to 4096: RESULTS.md, section 30)
MAX_PIECE = 16384  # a body with no cut for this long (a long system prompt, a file's content) is cut anyway
_SEAM = re.compile(rb"\}(?=\s*(?:,\s*\{|\]))")  # an array's object ends: the next begins, or the array ends
_RAW, _DEFLATED = b"\x00", b"\x01"
_DEFLATE_FROM = 128  # shorter pieces are kept as they are
_SPLIT = ("tools", "messages")  # the request fields stored as pieces of their own


def digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def wire_pieces(wire: bytes, start: int = 0) -> list[bytes]:
    """The body cut into pieces at the seams between objects of its arrays; their concatenation is `wire` (from
    `start`, a cut of the whole body's: the pieces after it)."""
    pieces: list[bytes] = []
    for seam in _SEAM.finditer(wire, start):
        cut = seam.end()  # after the object's `}`: the `,` or `]` that follows starts the next piece
        if cut - start < MIN_PIECE:
            continue
        while cut - start > MAX_PIECE:
            pieces.append(wire[start : start + MAX_PIECE])
            start += MAX_PIECE
        pieces.append(wire[start:cut])
        start = cut
    while len(wire) - start > MAX_PIECE:
        pieces.append(wire[start : start + MAX_PIECE])
        start += MAX_PIECE
    if start < len(wire) or not (pieces or start):
        pieces.append(wire[start:])
    return pieces


def request_pieces(request: JsonObject) -> list[bytes]:
    """The request as its skeleton, then its tool list, then each message (those that are lists only)."""
    split = [name for name in _SPLIT if isinstance(request.get(name), list)]
    skeleton = {key: None if key in split else value for key, value in request.items()}
    pieces = [orjson.dumps([split, skeleton])]
    if "tools" in split:
        pieces.append(orjson.dumps(request["tools"]))
    if "messages" in split:
        pieces += [orjson.dumps(message) for message in request["messages"]]
    return pieces


def request_from(hashes: Sequence[bytes], values: Mapping[bytes, Any]) -> JsonObject:
    """The request `request_pieces` cut into these pieces, from each piece's decoded value (`values`)."""
    split, skeleton = values[hashes[0]]
    rest = 1
    request: JsonObject = dict(skeleton)
    if "tools" in split:
        request["tools"] = values[hashes[1]]
        rest = 2
    if "messages" in split:
        request["messages"] = [values[h] for h in hashes[rest:]]
    return request


def pack(data: bytes) -> bytes:
    """A piece as stored: deflated if that is smaller."""
    if len(data) >= _DEFLATE_FROM:
        deflated = zlib.compress(data, 6)
        if len(deflated) < len(data):
            return _DEFLATED + deflated
    return _RAW + data


def unpack(stored: bytes) -> bytes:
    kind, data = stored[:1], stored[1:]
    return zlib.decompress(data) if kind == _DEFLATED else bytes(data)


def encode_parts(hashes: Sequence[bytes], base: Sequence[bytes] | None, same: int = 0) -> bytes:
    """A list of piece hashes, as how many of `base`'s first and last hashes it keeps and the hashes between them
    (all of them where there is no base): an episode's next call mostly adds a few pieces to the last one's. `same`:
    how many first hashes are said to be `base`'s (a `Cut`'s `kept`), checked in one comparison of the two lists
    (the same objects: a pointer each), so that only the hashes after them are compared one by one."""
    front = back = 0
    if base is not None:
        most = min(len(base), len(hashes))
        if 0 < same <= most and hashes[:same] == base[:same]:
            front = same
        while front < most and base[front] == hashes[front]:
            front += 1
        while back < most - front and base[-1 - back] == hashes[-1 - back]:
            back += 1
    middle = hashes[front : len(hashes) - back]
    return _varint(front) + _varint(back) + b"".join(middle)


def decode_parts(parts: bytes, base: Sequence[bytes] | None) -> list[bytes]:
    """The list of hashes `encode_parts` wrote, given the same base."""
    front, at = _read_varint(parts, 0)
    back, at = _read_varint(parts, at)
    middle = [parts[i : i + 32] for i in range(at, len(parts), 32)]
    if base is None:
        return middle
    return [*base[:front], *middle, *base[len(base) - back :]]


def middle_hashes(parts: bytes) -> Iterable[bytes]:
    """The hashes a parts value names itself (not those it keeps from its base)."""
    _, at = _read_varint(parts, 0)
    _, at = _read_varint(parts, at)
    return (parts[i : i + 32] for i in range(at, len(parts), 32))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        byte = data[at]
        at += 1
        n |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return n, at


class Cut:
    """A wire body and request as lists of piece hashes, where the wire's pieces end, and the pieces cut anew by
    their hash (all of them, but for `extended`'s); `kept`: how many first hashes of each list are an earlier cut's,
    the same objects (`extended`'s), the rest cut anew."""

    __slots__ = ("data", "ends", "kept", "request", "wire")

    def __init__(
        self,
        wire: list[bytes],
        ends: list[int],
        request: list[bytes],
        data: dict[bytes, bytes],
        kept: tuple[int, int] = (0, 0),
    ) -> None:
        self.wire, self.ends, self.request, self.data, self.kept = wire, ends, request, data, kept


def cut(wire: bytes, request: Any) -> Cut:
    """A wire body and request cut into pieces."""
    data: dict[bytes, bytes] = {}
    pieces = wire_pieces(wire)
    return Cut(_hashed(pieces, data), _ends(pieces, 0), _hashed(request_pieces(request), data), data)


def extended(wire: Body, messages: Sequence[Any], before: Cut, shared_bytes: int, shared_messages: int) -> Cut:
    """`cut(wire, request)` of a call whose wire body's first `shared_bytes` (to the end of its last message) and
    first `shared_messages` messages are an earlier call's, cut as `before`, and whose request is otherwise that
    call's (`proxy.core.values.Extension`): the earlier pieces are kept up to its last cut before the shared bytes
    end, and only what follows is cut.

    The same pieces as a cut of the whole: every cut before the shared bytes' last (a message's `}`) depends on
    those bytes alone, since a seam's lookahead stops at that `}`, and a cut forced by `MAX_PIECE` holds in both
    bodies once the next seam lies past it; so the whole cut of the new body passes the same cuts to there."""
    kept = bisect_left(before.ends, shared_bytes)  # the earlier pieces ending before the shared bytes do
    start = before.ends[kept - 1] if kept else 0
    data: dict[bytes, bytes] = {}
    if isinstance(wire, bytes):
        pieces = wire_pieces(wire, start)
    else:  # only what follows the kept pieces is copied out of the chunks: a cut depends on the bytes after it alone
        pieces = wire_pieces(after) if (after := wire.slice(start, len(wire))) else []
    new = [orjson.dumps(message) for message in messages[shared_messages:]]
    return Cut(
        before.wire[:kept] + _hashed(pieces, data),
        before.ends[:kept] + _ends(pieces, start),
        before.request + _hashed(new, data),
        data,
        (kept, len(before.request)),
    )


def _hashed(pieces: list[bytes], data: dict[bytes, bytes]) -> list[bytes]:
    hashes = []
    for piece in pieces:
        h = digest(piece)
        data[h] = piece
        hashes.append(h)
    return hashes


def _ends(pieces: list[bytes], start: int) -> list[int]:
    return list(accumulate((len(piece) for piece in pieces), initial=start))[1:]
