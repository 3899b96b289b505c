"""A continued call's body read against its episode's latest: the earlier body's bytes compared with its first and
last bytes (two memcmp), and only the messages between them parsed and checked.

An agent's next call usually repeats its last call's body byte for byte, with the reply and what followed added at the
end of `messages`: `{"model":…,"messages":[m0,…,mk` then `,mk+1,…` then `],"tools":[…]}`. Such a body is the earlier
one's bytes up to the end of its last message, new messages, and the earlier one's bytes from the end of its last
message on. Its request is then the earlier request with the new messages parsed and added: the same values a parse
of the whole body gives, since JSON reads a `,` and values after an array's last element as more elements of that
array and as nothing else. Where a body is not that (history rewritten, another layout or dialect, a part that does
not parse or check), it is parsed whole, as it always was, and the two ways answer alike: the incremental one gives
up on anything it does not prove, and the whole parse then says what is wrong.

The earlier body's messages' end is found by a scan of its JSON once (`messages_end`), when the first body of a chain
is extended, and carried forward by length after that.

Such a body is then held as those bytes: the earlier body's chunks up to the end of its messages, the new messages'
bytes, the earlier body's end (`Extended.wire`, `proxy.core.chunks.grown`), and the bytes it arrived in are let go. A
long episode's turns, kept at hand, hold its conversation a few times over, not once a turn (200 turns of a coding
agent: about 100 MB), and a turn's bytes are read into memory the turn before let go, not memory faulted in afresh.
"""

from __future__ import annotations

import re
from typing import Any, Protocol, TypeGuard

import orjson

from proxy.core.chunks import Body, Chunks, chunked, grown
from proxy.core.errors import BadRequest
from proxy.core.values import Extension, JsonObject
from proxy.dialects.dialect import Call, Dialect
from proxy.http.edge import MAX_JSON_DEPTH, nested_too_deep

EXTEND_FROM = 8192  # bodies shorter than this are parsed whole: it costs less than what holding them would
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)  # a JSON string, or a bracket
_COLON = re.compile(rb"\s*:")
_KEY = b'"messages"'
_SPACE = b" \t\r\n"


class Extendable(Protocol):
    """A dialect whose request is its body, so that a call's added messages can be checked alone."""

    name: str

    def parse_from(self, body: JsonObject, first: int) -> Call:
        """`parse(body)`, where the body's messages before `first` are known to be valid (an earlier call's)."""
        ...


def extendable(dialect: Dialect) -> TypeGuard[Extendable]:
    """Whether a dialect is `Extendable`: a look-up, where `isinstance` against a runtime-checkable protocol walks
    the protocol's members on every call (11 us, twice a turn)."""
    return callable(getattr(dialect, "parse_from", None))


class LastBody:
    """An episode's latest call, as the next is read against it: its body, where its last message ends (found when
    first needed), what follows its messages, and its request."""

    __slots__ = ("dialect", "end", "raw", "request", "tail", "turn_id")

    def __init__(self, turn_id: str, dialect: str, raw: Body, request: JsonObject, end: int | None, tail: bytes):
        self.turn_id, self.dialect, self.raw, self.request = turn_id, dialect, raw, request
        self.end, self.tail = end, tail  # end None: not looked for yet


class Extended:
    """A call read against the one before it: its request, and what it shares with the earlier one."""

    __slots__ = ("call", "extension", "tail", "wire")

    def __init__(self, call: Call, extension: Extension, tail: bytes, wire: Chunks) -> None:
        self.call, self.extension, self.tail = call, extension, tail
        self.wire = wire  # the body's bytes, the earlier body's where they are the same: the new ones let go


def extend(last: LastBody | None, raw: Body, dialect: Dialect) -> Extended | None:
    """The call, if its body is `last`'s with messages added (None: parse it whole)."""
    if last is None or last.dialect != dialect.name or not extendable(dialect):
        return None
    read = chunked(raw)
    if last.end is None:
        if len(raw) <= len(last.raw) or not read.same_start(last.raw, 256):  # no scan for a body that cannot extend it
            return None
        earlier = last.raw = bytes(last.raw)  # scanned whole, once a chain
        if (found := messages_end(earlier, len(last.request))) is None:
            return None
        last.end, last.tail = found, earlier[found:]
    end, tail = last.end, last.tail
    if len(raw) <= end + len(tail) or not read.endswith(tail) or not read.same_start(last.raw, end):
        return None
    between = read.slice(end, len(raw) - len(tail))
    added = between.lstrip(_SPACE)
    if not added.startswith(b","):
        return None
    try:
        new: Any = orjson.loads(b"[" + added[1:] + b"]")
    except orjson.JSONDecodeError:
        return None
    # the body nests as deep as its new messages do, plus its own level and the array's: the wrapper holds one of them
    deep = added.count(b"[") + added.count(b"{") >= MAX_JSON_DEPTH - 1 and nested_too_deep(new, MAX_JSON_DEPTH - 1)
    if not new or deep:
        return None
    old = last.request["messages"]
    body = dict(last.request)
    body["messages"] = old + new
    try:
        call = dialect.parse_from(body, len(old))
    except BadRequest:
        return None
    if call.request is not body:
        return None
    before = chunked(last.raw)
    wire = grown([*before.head(end), between], tail)
    return Extended(call, Extension(last.turn_id, len(old), end, _own(wire, before)), tail, wire)


def _own(wire: Chunks, earlier: Chunks) -> int:
    """The bytes of `wire` that are not the earlier body's (a chunk of it cut or joined is a copy)."""
    held = {id(part) for part in earlier.parts}
    return sum(len(part) for part in wire.parts if id(part) not in held)


def remember(turn_id: str, dialect: Dialect, raw: Body, call: Call, extended: Extended | None) -> LastBody | None:
    """What the episode's next call is read against, where it may be read so (a large body in a dialect whose
    request is its body)."""
    if len(raw) < EXTEND_FROM or not extendable(dialect) or not isinstance(call.request, dict):
        return None
    if extended is None:
        return LastBody(turn_id, dialect.name, raw, call.request, None, b"")
    end = len(raw) - len(extended.tail)
    return LastBody(turn_id, dialect.name, raw, call.request, end, extended.tail)


def messages_end(raw: bytes, keys: int) -> int | None:
    """Where the last message of a JSON object's top-level `messages` array ends (after its closing `}`), or None
    where that is not plain to see: no such array, an empty one, one whose last element is not an object, a
    `messages` key written with escapes, or a key written twice (`keys`: how many the object parsed to; the parse
    keeps a repeated key's last value). `raw` is valid JSON."""
    depth, seen, opened, close = 0, 0, -1, -1
    for token in _TOKEN.finditer(raw):
        at = token.start()
        byte = raw[at]
        if byte == 0x22:  # a string: at the top level, a key if a colon follows
            if depth == 1 and (colon := _COLON.match(raw, token.end())) is not None:
                seen += 1
                if token.end() - at == len(_KEY) and raw[at : token.end()] == _KEY:
                    value = colon.end()
                    while raw[value] in _SPACE:
                        value += 1
                    if opened >= 0 or raw[value] != 0x5B:  # [
                        return None
                    opened = value
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
        else:
            depth -= 1
            if depth == 1 and opened >= 0 and close < 0:
                close = at  # the first bracket to close at the top level after `messages` opened closes it
    if close < 0 or seen != keys:
        return None
    end = close
    while raw[end - 1] in _SPACE:
        end -= 1
    return end if end - 1 > opened and raw[end - 1] == 0x7D else None  # }
