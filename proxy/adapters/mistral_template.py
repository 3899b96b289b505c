"""MistralTemplate: a Mistral model's prompts written by mistral-common, Mistral's own tokenizer and renderer; the one
module that imports `mistral_common`.

mistral-common renders a conversation from its messages (`ChatCompletionRequest`, `encode_chat_completion`): user
turns in `[INST]...[/INST]`, replies closed by `</s>`, tool calls after `[TOOL_CALLS]` (a JSON list of calls with
their ids up to tokenizer v7; `name[ARGS]{...}` per call from v11), each result in `[TOOL_RESULTS]...[/TOOL_RESULTS]`,
and reasoning in `[THINK]...[/THINK]` where the tokenizer has those tokens (v13 on; earlier versions have nowhere to
write it, so it is left out). Where the tools and the system prompt go depends on the version: `[AVAILABLE_TOOLS]`
before the last user message (the first from v13), the system prompt in the last user message up to v3 and as
`[SYSTEM_PROMPT]...[/SYSTEM_PROMPT]` in its place from v7.

A continued turn's new messages are rendered after the parent's reply as mistral-common writes them at the end of a
conversation: each message's tokens depend on the message and on whether it holds the last user message, never on
how the earlier turns were written. So a continued turn shows the model what a full rendering would, but where the
last user message moved: a user message in the new ones gets `[AVAILABLE_TOOLS]` (tools placed at the last user
message) and, up to v3, the system prompt, while the earlier user message that had them keeps them, as the model
saw it; a full rendering would show them once, at the new last user message. Tool call ids are Mistral's nine
letters or digits: another id (an agent's `call_...`) is written as nine derived from it, the same each time.
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mistral_common.exceptions import MistralCommonException
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from mistral_common.tokens.tokenizers.utils import get_one_valid_tokenizer_file

from proxy.core.errors import UpstreamError
from proxy.core.values import JsonObject, text_of

_CALL_ID = re.compile(r"[a-zA-Z0-9]{9}")
_LETTERS = string.ascii_letters + string.digits
_STAND_IN_USER: JsonObject = {"role": "user", "content": "stand-in question"}
_STAND_IN_ANSWER = "stand-in answer"


class MistralTemplate:
    """One Mistral tokenizer (`tekken.json` or a sentencepiece `tokenizer.model.vN`) and its renderer."""

    def __init__(self, tokenizer: MistralTokenizer[Any, Any, Any, Any, Any]) -> None:
        self._tokenizer = tokenizer
        self._instruct: Any = tokenizer.instruct_tokenizer
        self._raw: Any = self._instruct.tokenizer
        self.end_of_turn: int = self._raw.eos_id
        self.stops: frozenset[int] = frozenset({self.end_of_turn})
        self.thinks: bool = getattr(self._instruct, "BEGIN_THINK", None) is not None  # reasoning has a place
        self.version: str = tokenizer.version.value

    def prompt(self, messages: Sequence[JsonObject], tools: Sequence[JsonObject] | None) -> list[int]:
        """The ids of a whole conversation, rendered for the model to reply to."""
        try:
            return self._render(messages, tools)
        except (MistralCommonException, ValueError, AssertionError) as e:
            raise UpstreamError(f"mistral-common cannot render this conversation: {_one_line(e)}") from e

    def delta(
        self,
        new: Sequence[JsonObject],
        tools: Sequence[JsonObject] | None,
        ended: bool,
        history: Sequence[JsonObject] = (),
    ) -> list[int] | None:
        """The ids mistral-common writes for `new` messages after a reply (`ended`: closed by `</s>`); None where it
        cannot say. `history` gives the system prompt (written into a new last user message up to v3) and the
        reply's tool calls (the order tool results are written in from v13)."""
        if not new or new[0].get("role") == "assistant":
            return None  # mistral-common merges consecutive replies: the new one would be written into the last
        system = [m for m in history if m.get("role") in ("system", "developer")]
        reply = history[-1] if history and history[-1].get("role") == "assistant" else None
        calls = (reply or {}).get("tool_calls") or _calls_answered(new)
        stand_in: JsonObject = {"role": "assistant", "content": None if calls else _STAND_IN_ANSWER}
        if calls:
            stand_in["tool_calls"] = calls
        try:
            ids = self._render([*system, _STAND_IN_USER, stand_in, *new], tools)
        except (MistralCommonException, ValueError, AssertionError):
            return None
        if self.end_of_turn not in ids:
            return None  # the stand-in reply was left out (v2 drops tool calls before the last user message)
        written = ids[ids.index(self.end_of_turn) + 1 :]
        return written if ended else [self.end_of_turn, *written]

    def encode(self, text: str) -> list[int]:
        return list(self._raw.encode(text, bos=False, eos=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), special_token_policy=SpecialTokenPolicy.KEEP))

    def _render(self, messages: Sequence[JsonObject], tools: Sequence[JsonObject] | None) -> list[int]:
        shaped = [self._message(m) for m in messages]
        request = ChatCompletionRequest.from_openai(shaped, tools=list(tools) if tools else None)
        return list(self._tokenizer.encode_chat_completion(request).tokens)

    def _message(self, message: JsonObject) -> JsonObject:
        """An OpenAI message as mistral-common takes it: text content, Mistral tool call ids, reasoning only where
        the tokenizer writes it."""
        role = message.get("role")
        content = message.get("content")
        text = content if content is None or isinstance(content, str) else text_of(content)
        if role in ("system", "developer"):
            return {"role": "system", "content": text or ""}
        if role == "tool":
            return {"role": "tool", "content": text or "", "tool_call_id": call_id(str(message.get("tool_call_id")))}
        if role != "assistant":
            return {"role": role, "content": text or ""}
        shaped: JsonObject = {"role": "assistant", "content": text or None}
        calls = message.get("tool_calls")
        if calls:
            shaped["tool_calls"] = [_call(call) for call in calls if isinstance(call, dict)]
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if self.thinks and isinstance(reasoning, str) and reasoning:
            shaped["reasoning_content"] = reasoning
        return shaped


def call_id(openai_id: str) -> str:
    """A tool call id as Mistral writes them (nine letters or digits): the id itself where it is one, else nine
    derived from it, the same each time."""
    if _CALL_ID.fullmatch(openai_id):
        return openai_id
    number = int.from_bytes(hashlib.sha256(openai_id.encode()).digest()[:8], "big")
    letters = []
    for _ in range(9):
        number, digit = divmod(number, len(_LETTERS))
        letters.append(_LETTERS[digit])
    return "".join(letters)


def _call(call: JsonObject) -> JsonObject:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    return {
        "id": call_id(str(call.get("id"))),
        "type": "function",
        "function": {
            "name": function.get("name") or "",
            "arguments": arguments if isinstance(arguments, str) else "{}" if arguments is None else arguments,
        },
    }


def _calls_answered(new: Sequence[JsonObject]) -> list[JsonObject]:
    """Stand-in calls for the tool results that open `new`, when the reply they answer is not at hand."""
    results = []
    for message in new:
        if message.get("role") != "tool":
            break
        name = message.get("name")
        function = {"name": name if isinstance(name, str) and name else "stand_in", "arguments": "{}"}
        results.append({"id": str(message.get("tool_call_id")), "type": "function", "function": function})
    return results


def load(where: str) -> MistralTemplate:
    """The template of the Mistral tokenizer at `where`: a tokenizer file, or a folder holding one (`tekken.json`
    first, as mistral-common picks)."""
    path = Path(where)
    try:
        file = get_one_valid_tokenizer_file([str(p) for p in path.iterdir()]) if path.is_dir() else str(path)
        return MistralTemplate(MistralTokenizer.from_file(file))
    except (OSError, ValueError, MistralCommonException) as e:
        raise UpstreamError(f"no Mistral tokenizer could be loaded from {where!r}: {_one_line(e)}") from e


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
