"""Token ids as JSON text, for a served policy's trip to its server and back: a continued turn's ids are sent, and
the server's echo of them read, as bytes (one copy, one comparison), never as a Python int per id.

A turn's prompt ids are its parent's prompt and sampled ids and a few more: the JSON text of the parent's ids is kept
(`IdsJson`, bounded by its bytes) so the child's is the parent's text and its own few ids joined, and the prompt ids
the server echoes back (vLLM's `prompt_token_ids`, the whole conversation's on every turn) are cut out of its answer
(`cut_echo`) and compared as text with what was sent, or with the parent's ids where the server rendered the prompt
itself; only the ids after the parent's are parsed. Where the text differs (another spacing, ids that drifted) the
answer is parsed whole, as before.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core.errors import UpstreamError
from proxy.core.values import JsonObject

_KEPT_BYTES = 64 << 20  # the ids kept for turns' children, all episodes together: their text, and 8 bytes an id
_NAME = b'"prompt_token_ids"'
_ECHO = re.compile(re.escape(_NAME) + rb"\s*:\s*")
_DIGITS = b"0123456789,"  # an echo as servers write it: compact, non-negative ids


def dumped(ids: Sequence[int]) -> bytes:
    return orjson.dumps(ids)


def joined(*arrays: bytes) -> bytes:
    """JSON arrays' text as one array's: `[1,2]`, `[]`, `[3]` -> `[1,2,3]` (one copy of their bytes)."""
    parts: list[bytes | memoryview] = [b"["]
    for array in arrays:
        if len(array) > 2:
            parts += (memoryview(array)[1:-1], b",")
    if len(parts) > 1:
        parts[-1] = b"]"  # the last comma
    else:
        parts.append(b"]")
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class _Kept:
    prompt: Sequence[int]
    sampled: Sequence[int]
    text: bytes  # the JSON of prompt then sampled

    @property
    def size(self) -> int:
        return len(self.text) + 8 * (len(self.prompt) + len(self.sampled))


class IdsJson:
    """The JSON text of the latest turns' prompt and sampled ids, by the objects holding them (a turn's reply keeps
    them as it was made; one read back from the database is dumped again)."""

    def __init__(self, kept_bytes: int = _KEPT_BYTES) -> None:
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._bytes = 0
        self._limit = kept_bytes

    def of(self, prompt: Sequence[int], sampled: Sequence[int]) -> bytes:
        """The JSON of `prompt` then `sampled`."""
        kept = self._kept.get(id(prompt))
        if kept is not None and kept.prompt is prompt and kept.sampled is sampled:
            self._kept.move_to_end(id(prompt))
            return kept.text
        return joined(dumped(prompt), dumped(sampled))

    def keep(self, prompt: Sequence[int], sampled: Sequence[int], text: bytes) -> None:
        """Keep the JSON (`text`) of a new turn's prompt then sampled ids, for its child."""
        if (before := self._kept.pop(id(prompt), None)) is not None:
            self._bytes -= before.size
        kept = self._kept[id(prompt)] = _Kept(prompt, sampled, text)
        self._bytes += kept.size
        while self._bytes > self._limit and self._kept:
            _, gone = self._kept.popitem(last=False)
            self._bytes -= gone.size


@dataclass(frozen=True, slots=True)
class Echo:
    """A server's answer with its echo of the prompt ids cut out: the answer parsed (the echo's value null), and the
    echo's text."""

    response: JsonObject
    text: bytes


def cut_echo(content: bytes, where: str) -> Echo | None:
    """The answer, parsed with its one `prompt_token_ids` (at the top level, `where="top"`, or on the first choice,
    `where="choice"`) left out as text; None where the answer holds no such echo, or one not as servers write it."""
    found = _echo_at(content)
    if found is None:
        return None
    start, end = found
    text = content[start:end]
    if text.translate(None, _DIGITS) != b"[]":  # one pass in C
        return None
    whole = memoryview(content)
    try:
        response = orjson.loads(b"".join((whole[:start], b"null", whole[end:])))
    except orjson.JSONDecodeError:
        return None
    holder: Any = response
    if where == "choice":
        choices = response.get("choices") if isinstance(response, dict) else None
        holder = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(holder, dict) or "prompt_token_ids" not in holder or holder["prompt_token_ids"] is not None:
        return None  # the one key cut was not where the ids are read from
    return Echo(response, text)


def _echo_at(content: bytes) -> tuple[int, int] | None:
    """Where the value of the answer's one `"prompt_token_ids"` key lies, an array up to its first `]`; None where
    there is no such key, more than one, or its value does not open an array. The name is searched for in C, around
    the array (of digits and commas, which `cut_echo` checks, and so not holding the name): a regex search would step
    through every digit."""
    found = None
    at = content.find(_NAME)
    while at >= 0:
        key = _ECHO.match(content, at)
        if key is None:
            at = content.find(_NAME, at + 1)
            continue
        if found is not None:
            return None
        start = key.end()
        end = content.find(b"]", start) + 1
        if content[start : start + 1] != b"[" or not end:
            return None
        found = (start, end)
        at = content.find(_NAME, end)
    return found


def after(echo: bytes, before: bytes) -> list[int] | None:
    """The ids an echo's text (`cut_echo`) holds after those of `before` (another array's text), where it begins
    with them all; None where it does not."""
    head = memoryview(before)[:-1]
    if len(head) < 2 or not echo.startswith(head):  # one comparison of bytes
        return None
    rest = echo[len(head) :]
    if rest == b"]":
        return []
    if not rest.startswith(b","):
        return None
    return list(orjson.loads(b"[" + rest[1:]))


def answer_of(content: bytes) -> JsonObject:
    """A server's answer parsed, if it is JSON with choices."""
    try:
        response = orjson.loads(content)
    except orjson.JSONDecodeError as e:
        raise UpstreamError("the policy's server answered with something other than JSON") from e
    return with_choices(response)


def with_choices(response: Any) -> JsonObject:
    if not isinstance(response, dict) or not response.get("choices"):
        raise UpstreamError("the policy's server answered with no choices")
    return response
