"""HarmonyTemplate and the `harmony` tool parser: gpt-oss's prompts written and its replies read by openai-harmony,
OpenAI's own renderer of the harmony format; the one module that imports `openai_harmony`.

A harmony conversation is a system message (model identity, reasoning effort, the channels), a developer message
(the agent's system prompt as instructions, its function tools as a TypeScript-like namespace), then messages each
`<|start|>ROLE<|channel|>CHANNEL<|message|>...<|end|>`. A reply writes its reasoning on the `analysis` channel, its
answer on `final` and ends it with `<|return|>`; a tool call goes `to=functions.NAME` on `commentary` and ends with
`<|call|>`; a result comes back from `functions.NAME`. Rendering a whole conversation, harmony writes an answer's
`<|return|>` as `<|end|>` and drops the reasoning of every turn that ended in a final answer.

A continued turn's new messages are rendered as harmony writes them after a reply, up to the next
`<|start|>assistant`: the model then sees its reply as it sampled it (ending in `<|call|>` or `<|return|>`, its
reasoning kept) where a full rendering would write `<|end|>` and drop the reasoning of answered turns. A reply cut
by `max_tokens` is closed with `<|end|>` first, as harmony closes a message in history.

harmony loads the o200k vocabulary on first use, downloading it unless it is found: offline, it is read from the
copy litellm ships (its tiktoken cache folder, set as `TIKTOKEN_RS_CACHE_DIR` unless that or
`TIKTOKEN_ENCODINGS_BASE` is set already); harmony checks its SHA-256 either way.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.adapters.parsed import NotArguments, Parsed, ToolCall, arguments_text
from proxy.adapters.tiktoken_counter import _bundled_bpe_dir
from proxy.core.errors import UpstreamError
from proxy.core.values import JsonObject, text_of

_O200K_CACHED = "fb374d419588a4632f3f557e76b4b70aebbca790"  # tiktoken's cache name of o200k_base: its URL's SHA-1
_FUNCTIONS = "functions."
_JSON = "<|constrain|>json"
# A reply's text is encoded in pieces of at most `_PIECE` characters: tiktoken's byte-pair merge takes time quadratic
# in the length of a run the vocabulary's pattern does not split (a long word, or `[{` repeated). A piece ends before
# a space or newline where one is near, and never inside a special token; any cut decodes to the same text.
_PIECE = 1024
_SPECIAL_CHARS = 48  # longer than any special token's name (`<|reserved_200017|>`)
# A header (role, channel, recipient, content type) is a few tokens; openai-harmony reads one at ~40 us a token,
# so one longer than this is refused before it is read.
_HEADER_TOKENS = 256


class _Unparsed(Exception):
    """Harmony messages that are not a reply an agent can take; the message is the one line `Parsed.error` carries."""


@functools.cache
def harmony() -> tuple[Any, Any]:
    """openai_harmony and its gpt-oss encoding, loaded once (a second: the vocabulary is read and checked)."""
    bundled = _bundled_bpe_dir()
    unset = not {"TIKTOKEN_RS_CACHE_DIR", "TIKTOKEN_ENCODINGS_BASE"} & os.environ.keys()
    if unset and bundled and (Path(bundled) / _O200K_CACHED).is_file():
        os.environ["TIKTOKEN_RS_CACHE_DIR"] = bundled
    try:
        # lazy: only a gpt-oss policy in tokens mode needs it, and it is in the `served` extra only
        import openai_harmony
    except ImportError as e:
        raise UpstreamError("gpt-oss in tokens mode needs openai-harmony: install trajproxy[served]") from e
    try:
        return openai_harmony, openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:  # HarmonyError is a RuntimeError raised for any failure to find or read the vocabulary
        raise UpstreamError(f"openai-harmony could not load gpt-oss's vocabulary: {' '.join(str(e).split())}") from e


class HarmonyTemplate:
    """gpt-oss's renderer; `reasoning_effort` (low, medium, high) goes into the system message."""

    def __init__(self, reasoning_effort: str | None = None) -> None:
        self._h, self._encoding = harmony()
        self._system = self._h.SystemContent.new()
        if reasoning_effort is not None:
            efforts = {effort.value.lower(): effort for effort in self._h.ReasoningEffort}
            if reasoning_effort.lower() not in efforts:
                raise UpstreamError(f"reasoning_effort {reasoning_effort!r}: one of {', '.join(efforts)}")
            self._system = self._system.with_reasoning_effort(efforts[reasoning_effort.lower()])
        special = self._encoding.encode
        self.end_of_turn: int = special("<|return|>", allowed_special="all")[0]
        self._end: int = special("<|end|>", allowed_special="all")[0]
        self.stops: frozenset[int] = frozenset(self._encoding.stop_tokens_for_assistant_actions())

    def prompt(self, messages: Sequence[JsonObject], tools: Sequence[JsonObject] | None) -> list[int]:
        """The ids of a whole conversation, rendered for the model to reply to."""
        h = self._h
        leading = 0
        while leading < len(messages) and messages[leading].get("role") in ("system", "developer"):
            leading += 1
        head = [h.Message.from_role_and_content(h.Role.SYSTEM, self._system)]
        instructions = "\n\n".join(text_of(m.get("content")) for m in messages[:leading])
        if instructions or tools:
            developer = h.DeveloperContent.new()
            if instructions:
                developer = developer.with_instructions(instructions)
            if tools:
                developer = developer.with_function_tools([self._tool(t) for t in tools])
            head.append(h.Message.from_role_and_content(h.Role.DEVELOPER, developer))
        names = _names(messages)
        body = [m for message in messages[leading:] for m in self._messages(message, names)]
        return self._render([*head, *body])

    def delta(
        self,
        new: Sequence[JsonObject],
        tools: Sequence[JsonObject] | None,
        ended: bool,
        history: Sequence[JsonObject] = (),
    ) -> list[int] | None:
        """The ids harmony writes for `new` messages after a reply, up to the next `<|start|>assistant`
        (`ended`: closed by `<|call|>` or `<|return|>`); None where a tool result's function is not known (from the
        calls of the reply that ends `history`, or the result's `name`)."""
        names = _names([*history[-1:], *new])  # results answer the reply they follow: a cost that does not grow
        if any(m.get("role") == "tool" and names.get(str(m.get("tool_call_id"))) is None for m in new):
            return None
        written = self._render([m for message in new for m in self._messages(message, names)])
        return written if ended else [self._end, *written]

    def encode(self, text: str) -> list[int]:
        return list(self._encoding.encode(text, disallowed_special=()))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._encoding.decode(list(ids)))

    def _render(self, messages: list[Any]) -> list[int]:
        conversation = self._h.Conversation.from_messages(messages)
        return list(self._encoding.render_conversation_for_completion(conversation, self._h.Role.ASSISTANT))

    def _tool(self, tool: JsonObject) -> Any:
        function = tool.get("function") or {}
        return self._h.ToolDescription.new(
            function.get("name") or "", function.get("description") or "", parameters=function.get("parameters")
        )

    def _messages(self, message: JsonObject, names: dict[str, str]) -> list[Any]:
        """One OpenAI message as harmony messages: a reply's reasoning, text and each call are one apiece."""
        h, role, text = self._h, message.get("role"), text_of(message.get("content"))
        if role in ("system", "developer"):  # one past the conversation's head: instructions in their place
            return [h.Message.from_role_and_content(h.Role.DEVELOPER, h.DeveloperContent.new().with_instructions(text))]
        if role == "tool":
            author = h.Author.new(h.Role.TOOL, _FUNCTIONS + names.get(str(message.get("tool_call_id")), "unknown"))
            return [
                h.Message.from_author_and_content(author, text).with_channel("commentary").with_recipient("assistant")
            ]
        if role != "assistant":
            return [h.Message.from_role_and_content(h.Role.USER, text)]
        found = []
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            found.append(h.Message.from_role_and_content(h.Role.ASSISTANT, reasoning).with_channel("analysis"))
        calls = [c.get("function") or {} for c in message.get("tool_calls") or () if isinstance(c, dict)]
        if text:  # text beside calls is a preamble, on the calls' channel
            channel = "commentary" if calls else "final"
            found.append(h.Message.from_role_and_content(h.Role.ASSISTANT, text).with_channel(channel))
        for call in calls:
            arguments = call.get("arguments")
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)
            call_message = h.Message.from_role_and_content(h.Role.ASSISTANT, arguments).with_channel("commentary")
            found.append(call_message.with_recipient(_FUNCTIONS + str(call.get("name"))).with_content_type(_JSON))
        return found


def _names(messages: Sequence[JsonObject]) -> dict[str, str]:
    """The function each tool call id called, and the names tool results give themselves."""
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                names[str(call.get("id"))] = function["name"]
        if message.get("role") == "tool" and isinstance(message.get("name"), str):
            names.setdefault(str(message.get("tool_call_id")), message["name"])
    return names


@dataclass(frozen=True, slots=True)
class HarmonyParser:
    """Reads a gpt-oss reply with openai-harmony's parser: `analysis` is reasoning, `final` (and a `commentary`
    preamble) the content, each `commentary` message to `functions.NAME` a call."""

    name: str = "harmony"

    def parse(self, text: str, tools: Sequence[JsonObject]) -> Parsed:
        try:
            _, encoding = harmony()
        except UpstreamError as e:
            return Parsed(text.strip() or None, None, (), error=f"{self.name}: {e}")
        return self.parse_ids(_encoded(encoding, text), tools, text)

    def parse_ids(self, ids: Sequence[int], tools: Sequence[JsonObject], text: str | None = None) -> Parsed:
        """The reply in the ids sampled, which need not end with `<|call|>` or `<|return|>` (cut, or the stop left
        out); `text`, if given, is what an error keeps as content."""
        try:
            h, encoding = harmony()
        except UpstreamError as e:
            return Parsed((text or "").strip() or None, None, (), error=f"{self.name}: {e}")
        try:
            _check_headers(encoding, ids)
            messages = encoding.parse_messages_from_completion_tokens(list(ids), h.Role.ASSISTANT, strict=False)
            reasoning, content, calls = _read(messages)
        # HarmonyError is a RuntimeError, as is RecursionError; ValueError is JSON's on a number too long
        except (RuntimeError, ValueError, _Unparsed) as e:
            whole = encoding.decode(list(ids)) if text is None else text
            return Parsed(whole.strip() or None, None, (), error=f"{self.name}: " + " ".join(str(e).split()))
        return Parsed(content, reasoning, calls)


HARMONY = HarmonyParser()


def _encoded(encoding: Any, text: str) -> list[int]:
    """The text's ids, special tokens read as such, in time linear in the text."""
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = min(start + _PIECE, len(text))
        if end < len(text):
            half = start + _PIECE // 2
            end = max(text.rfind(" ", half, end), text.rfind("\n", half, end), half)
            opened = text.rfind("<|", max(start + 1, end - _SPECIAL_CHARS), end)
            if opened != -1 and text.find("|>", opened + 2, end + _SPECIAL_CHARS) >= end - 1:
                end = opened  # the cut would fall inside what may be a special token: cut before it
        ids += encoding.encode(text[start:end], allowed_special="all")
        start = end
    return ids


@functools.cache
def _markers(encoding: Any) -> tuple[int, frozenset[int]]:
    """The ids of `<|message|>`, which ends a header, and of the tokens that end a message's content."""
    (message,) = encoding.encode("<|message|>", allowed_special="all")
    ends = frozenset(encoding.encode(end, allowed_special="all")[0] for end in ("<|end|>", "<|call|>", "<|return|>"))
    return message, ends


def _check_headers(encoding: Any, ids: Sequence[int]) -> None:
    """Raises _Unparsed where a message's header runs past `_HEADER_TOKENS`, in one pass over the ids."""
    message, ends = _markers(encoding)
    header: int | None = 0  # the tokens of the header being read; None in a message's content
    for token in ids:
        if header is None:
            header = 0 if token in ends else None
        elif token == message:
            header = None
        elif (header := header + 1) > _HEADER_TOKENS:
            raise _Unparsed(f"a message header runs past {_HEADER_TOKENS} tokens with no <|message|>")


def _read(messages: Sequence[Any]) -> tuple[str | None, str | None, tuple[ToolCall, ...]]:
    thoughts: list[str] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for message in messages:
        text = "".join(getattr(part, "text", "") for part in message.content)
        recipient = message.recipient or ""
        if recipient.startswith(_FUNCTIONS):
            calls.append(ToolCall(recipient.removeprefix(_FUNCTIONS), _arguments(text, recipient)))
        elif recipient and recipient != "assistant":
            raise _Unparsed(f"a call to {recipient}, which is not a function tool")
        elif message.channel == "analysis":
            thoughts.append(text)
        else:
            texts.append(text)
    thought, said = "\n".join(thoughts).strip(), "\n".join(texts).strip()
    return thought or None, said or None, tuple(calls)


def _arguments(text: str, recipient: str) -> str:
    try:
        return arguments_text(text)
    except NotArguments as e:
        raise _Unparsed(f"{recipient}: {e}") from e
