"""Token ids as JSON text, for a served policy's trip to its server and back: a continued turn's ids are sent, and
the server's echo of them read, as bytes (one copy, one comparison), never as a Python int per id.

A turn's prompt ids are its parent's prompt and sampled ids and a few more: the JSON text of the parent's ids is kept
(`IdsJson`, bounded by its bytes, and let go once a child's is kept: a chain holds its latest turn's alone, so that a
long episode's earlier bodies are freed turn by turn and their memory used again, not 64 MiB of them held and every
turn's new body faulted in afresh, RESULTS.md section 40) so the child's is the parent's text and its own few ids
joined, and the prompt ids
the server echoes back (vLLM's `prompt_token_ids`, the whole conversation's on every turn) are cut out of its answer
(`cut_echo`) and compared as text with what was sent, or with the parent's ids where the server rendered the prompt
itself; only the ids after the parent's are parsed. Where the text differs (another spacing, ids that drifted) the
answer is parsed whole, as before.

An array's text is held in pieces (`Pieces`: `[`, the ids' text, `]`), views into the bytes that hold it (the body
sent, the server's answer), so that the conversation's ids are copied once a turn, into the body sent: the parent's
text, the ids sampled and the new ids are joined there, and the echo is compared with them where it lies in the
answer, without cutting it out or checking its characters (what was sent holds digits and commas only).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import orjson

from proxy.core.chunks import Chunks, doubled
from proxy.core.errors import UpstreamError
from proxy.core.ids import TokenIds, plain
from proxy.core.values import JsonObject

_KEPT_BYTES = 64 << 20  # the ids kept for turns' children, all episodes together: their text, and 8 bytes an id
_NAME = b'"prompt_token_ids"'
_ECHO = re.compile(re.escape(_NAME) + rb"\s*:\s*")
_DIGITS = b"0123456789,"  # an echo as servers write it: compact, non-negative ids
_PAST_IDS = 1 << 63  # ids are held as signed 64-bit integers (`proxy.core.ids`)
_KEY_MOST = len(_NAME) + 64  # the name, the colon and the spaces around it, as far as an echo's are looked for


Text = bytes | memoryview
Pieces = tuple[Text, ...]  # an array's JSON text: `[`, the ids' text in pieces (none where empty), `]`
_EMPTY: Pieces = (b"[", b"]")


def dumped(ids: Sequence[int]) -> bytes:
    return orjson.dumps(plain(ids))


def pieces(array: Text) -> Pieces:
    """An array's JSON text (compact, as `dumped` writes it) in pieces: a view of its ids' text, not a copy."""
    return (b"[", memoryview(array)[1:-1], b"]") if len(array) > 2 else _EMPTY


def chained(*arrays: Pieces) -> Pieces:
    """Arrays' text as one array's, in pieces: `[1,2]`, `[]`, `[3]` -> `[`, `1,2`, `,`, `3`, `]` (nothing copied)."""
    inner: list[Text] = []
    for array in arrays:
        if len(array) > 2:
            inner += (*array[1:-1], b",")
    return (b"[", *inner[:-1], b"]") if inner else _EMPTY


def compacted(array: Pieces, most: int = 16) -> Pieces:
    """An array's pieces as they are, or, where there are more than `most`, `doubled`: a text kept from turn to turn
    gains a few small pieces a turn, and so held each of its bytes is copied a few times in all, not once a turn."""
    return array if len(array) <= most else (b"[", *doubled(array[1:-1]), b"]")


def joined(*arrays: Text) -> bytes:
    """JSON arrays' text as one array's: `[1,2]`, `[]`, `[3]` -> `[1,2,3]` (one copy of their bytes)."""
    return b"".join(chained(*map(pieces, arrays)))


def held_bytes(array: Pieces) -> int:
    """The bytes an array's pieces hold in memory: all of what a view looks into."""
    return sum(len(piece.obj) if isinstance(piece, memoryview) else len(piece) for piece in array)  # type: ignore[misc,arg-type]


@dataclass(frozen=True, slots=True)
class _Kept:
    prompt: Sequence[int]
    sampled: Sequence[int]
    text: Pieces  # the JSON of prompt then sampled

    @property
    def size(self) -> int:
        """Its text's, and its ids' at 8 bytes each: of a served prompt (TokenIds), its own ids only, its head being
        its parent's prompt (`proxy/core/ids.py`)."""
        prompt = self.prompt.own_bytes if isinstance(self.prompt, TokenIds) else 8 * len(self.prompt)
        return held_bytes(self.text) + prompt + 8 * len(self.sampled)


class IdsJson:
    """The JSON text of the latest turns' prompt and sampled ids, by the objects holding them (a turn's reply keeps
    them as it was made; one read back from the database is dumped again)."""

    def __init__(self, kept_bytes: int = _KEPT_BYTES) -> None:
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._bytes = 0
        self._limit = kept_bytes

    def of(self, prompt: Sequence[int], sampled: Sequence[int]) -> Pieces:
        """The JSON of `prompt` then `sampled`, in pieces."""
        kept = self._kept.get(id(prompt))
        if kept is not None and kept.prompt is prompt and kept.sampled is sampled:
            self._kept.move_to_end(id(prompt))
            return kept.text
        return chained(pieces(dumped(prompt)), pieces(dumped(sampled)))

    def keep(
        self, prompt: Sequence[int], sampled: Sequence[int], text: Pieces, parent: Sequence[int] | None = None
    ) -> None:
        """Keep the JSON (`text`, in pieces) of a new turn's prompt then sampled ids, for its child; its parent's
        (`parent`, its prompt) is let go."""
        for key in (id(prompt), id(parent)):
            if (before := self._kept.pop(key, None)) is not None:
                self._bytes -= before.size
        kept = self._kept[id(prompt)] = _Kept(prompt, sampled, text)
        self._bytes += kept.size
        while self._bytes > self._limit and self._kept:
            _, gone = self._kept.popitem(last=False)
            self._bytes -= gone.size


@dataclass(frozen=True, slots=True)
class Echo:
    """A server's answer with its echo of the prompt ids cut out: the answer parsed (the echo's value null), the echo's
    text (in pieces: views into the answer), and where the ids `cut_echo` was told of were found at its start, the
    text after them (`,4,5]`, or `]` where there are no more); else None."""

    response: JsonObject
    text: Pieces
    after: bytes | None


def cut_echo(content: Chunks, where: str, known: Pieces = _EMPTY) -> Echo | None:
    """The answer, parsed with its one `prompt_token_ids` (at the top level, `where="top"`, or on the first choice,
    `where="choice"`) left out as text; None where the answer holds no such echo, or one not as servers write it.
    `known`: ids the echo is expected to begin with (those sent, or the parent's), compared where the echo lies (one
    comparison of bytes a piece); only the text after them is checked for what it holds."""
    found = _echo_at(content, known)
    if found is None:
        return None
    start, head, end = found
    rest = content.slice(head, end)  # all of the echo where it does not begin with `known`
    if rest.translate(None, _DIGITS) != (b"]" if head > start else b"[]"):  # one pass in C, over what is not known
        return None
    try:
        response = orjson.loads(b"".join((content.slice(0, start), b"null", content.slice(end, content.size))))
    except orjson.JSONDecodeError:
        return None
    holder: Any = response
    if where == "choice":
        choices = response.get("choices") if isinstance(response, dict) else None
        holder = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(holder, dict) or "prompt_token_ids" not in holder or holder["prompt_token_ids"] is not None:
        return None  # the one key cut was not where the ids are read from
    text: Pieces = (b"[", *content.views(start + 1, end - 1), b"]") if end - start > 2 else _EMPTY
    return Echo(response, text, rest if head > start else None)


def _held(content: Chunks, at: int, known: Pieces) -> int:
    """Where the ids of `known` (not empty) end in `content`, where its text from `at` begins with them and then ends
    or goes on with another id; `at` where not."""
    if len(known) <= 2:
        return at
    end = at
    for piece in known[:-1]:  # `[`, the ids' pieces: a handful, whatever the ids' number
        if not content.startswith(piece, end):
            return at
        end += len(piece)
    return end if content.slice(end, end + 1) in (b",", b"]") else at


def _echo_at(content: Chunks, known: Pieces) -> tuple[int, int, int] | None:
    """Where the value of the answer's one `"prompt_token_ids"` key lies, an array up to its first `]`, and where in
    it the ids of `known` end (`_held`); None where there is no such key, more than one, or its value does not open an
    array. The name is searched for in C, around the array (of digits and commas, which `cut_echo` checks, and so not
    holding the name): a regex search would step through every digit. The array's end is searched for after the ids
    known (digits and commas, which `_held` compared): the echo's bytes are read once, not again for its end."""
    found = None
    at = content.find(_NAME)
    while at >= 0:
        key = _ECHO.match(content.slice(at, at + _KEY_MOST))
        if key is None:
            at = content.find(_NAME, at + 1)
            continue
        if found is not None:
            return None
        start = at + key.end()
        if content.slice(start, start + 1) != b"[":
            return None
        head = _held(content, start, known)
        end = content.find(b"]", head) + 1
        if not end:
            return None
        found = (start, head, end)
        at = content.find(_NAME, end)
    return found


def new_ids(echo: Echo) -> list[int] | None:
    """The ids an echo holds after those `cut_echo` was told of, where it begins with them all; None where not."""
    if echo.after is None:
        return None
    if echo.after == b"]":
        return []
    try:
        ids = orjson.loads(b"[" + echo.after[1:])
    except orjson.JSONDecodeError:  # commas out of place: the whole echo's parse says so
        return None
    return ids if ids and token_ids(ids) else None  # `,]` is no id; nor one past 64 bits: the whole parse says so


def token_ids(value: Any, empty: bool = False) -> TypeGuard[list[int]]:
    """Whether `value` is a list of token ids: integers from 0 to 2**63 - 1 (no bool, float, string or null), and not
    empty unless `empty`. In C, a pass or two over a copy as JSON (a prompt's ids are the whole conversation's)."""
    if not isinstance(value, list) or not (value or empty):
        return False
    try:
        written = orjson.dumps(value)
    except orjson.JSONEncodeError:  # past 64 bits
        return False
    return not written[1:-1].translate(None, _DIGITS) and (not value or max(value) < _PAST_IDS)


def answer_of(content: Chunks) -> JsonObject:
    """A server's answer parsed, if it is JSON with choices."""
    return with_choices(json_object(content))


def json_object(content: Chunks) -> JsonObject:
    """A server's answer parsed, if it is a JSON object."""
    try:
        response = orjson.loads(content.joined())
    except orjson.JSONDecodeError as e:
        raise UpstreamError("the policy's server answered with something other than JSON") from e
    if not isinstance(response, dict):
        raise UpstreamError("the policy's server answered with JSON that is not an object")
    return response


def with_choices(response: Any) -> JsonObject:
    if not isinstance(response, dict) or not response.get("choices"):
        raise UpstreamError("the policy's server answered with no choices")
    return response
