"""ChatTemplates: a served model's own chat template and tokenizer, as token in, token out needs them; the one module
that imports `transformers`.

A turn that continues its parent is prompted with the parent's prompt ids, the ids the parent sampled, and the
template's tokens for the new messages only. Those are found by rendering the new messages after a stand-in
conversation (a user message and an assistant reply) and keeping what the template writes after the stand-in
reply's end-of-turn text, in that one rendering: the stand-in reply is never compared with a rendering without
the new messages, so a template that writes a reply one way while it is last and another once messages follow it
(Qwen3's reasoning and empty think block, DeepSeek's `</think>`), that adds a default system prompt, or that groups
tool results into one turn, is continued all the same. What the template writes for a message depends on that
message, the ones after it and the reply it follows, never on the history before: the stand-in is that history.
The cost is the new messages' (and the tools'), whatever the conversation's length.

Where the template closes the stand-in reply otherwise once messages follow (its end-of-turn text is not right
after the reply's text), or refuses the new messages after a reply, `delta` raises `Discontinuity`: the ids cannot
be attributed, and the episode's `on_discontinuity` says what happens. Where the parent's sampled ids did not end
the turn (cut by `max_tokens`), the end-of-turn token the template would have written comes first; a family whose
model stops on the next turn's role token (GLM) needs none: the delta begins with that token.

A family's renderer is this class by default (`jinja`); `RENDERERS` maps the other names an entry of
`proxy/families` may give (Mistral's `mistral`, gpt-oss's `harmony`: official renderers that are packages) to the
module that builds theirs (`proxy/adapters/renderer.py` is what each provides).
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from proxy.adapters.token_bytes import text_bytes, token_bytes
from proxy.core.errors import UpstreamError
from proxy.core.ids import plain
from proxy.core.values import JsonObject
from proxy.families import GENERAL, Family, detect, named

_STAND_IN: tuple[JsonObject, ...] = (
    {"role": "user", "content": "\u2063stand-in question\u2063"},
    {"role": "assistant", "content": "\u2063stand-in answer\u2063"},
)
_ANSWER = _STAND_IN[1]["content"]


@dataclass(frozen=True, slots=True)
class Difference:
    """Where a rendering of the whole conversation first differs from the text of the ids sent, with a little of
    each from there: what a chat-endpoint prompt would have held instead (earlier reasoning dropped, say)."""

    at: int
    rendered: str
    sent: str


class Discontinuity(ValueError):
    """The template cannot say which ids it writes for the new messages after a reply; the message says why."""


class ChatTemplate:
    """One model's tokenizer and chat template (with `chat_template`, another template in place of its own), and the
    family it belongs to."""

    def __init__(
        self, tokenizer: Any, chat_template: str | None, options: JsonObject, family: Family = GENERAL
    ) -> None:
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._options = options  # chat_template_kwargs, e.g. enable_thinking
        self.family = family
        closing = self.render([*_STAND_IN], None, generation_prompt=False)
        after = closing[closing.rindex(_ANSWER) + len(_ANSWER) :]
        end, self._closing = self._end(after)
        self.end_of_turn: int = end
        single = (tokenizer.encode(text, add_special_tokens=False) for text in family.end_of_turn)
        self.stops: frozenset[int] = frozenset({end, *(ids[0] for ids in single if len(ids) == 1)})
        # transformers' encode hands even one text to the Rust tokenizer's thread pool (encode_batch), a wake-up of
        # other threads per call; the Rust tokenizer's own encode does the same on this thread. Used only where it
        # neither truncates nor pads, as transformers' encode above has set it.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = backend is not None and backend.truncation is None and backend.padding is None
        self._backend: Any = backend if plain else None
        # its batch encode without offsets (tokenizers 0.19 on): the same ids, ~15-20% less CPU for a tool result's
        # 3 KB, where the offsets, kept per token, are never read
        self._fast: Any = getattr(backend, "encode_batch_fast", None) if plain else None
        # its decode, where transformers' adds nothing to it (no clean-up of spaces): transformers' first walks the
        # ids in Python, as long again as the Rust decode for a whole conversation's
        clean = getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._decoder: Any = backend if backend is not None and clean is False else None
        # and where that decode is a byte-level one's, each id's bytes: a whole conversation's text compared as
        # bytes joined in C, 3 ms at 90k ids where the Rust decode takes 10
        self._bytes = token_bytes(backend) if self._decoder is not None else None

    def _end(self, after: str) -> tuple[int, str]:
        """The end-of-turn id, and the text the template writes after a reply's text up to and with it (none for a
        family whose model stops on the next turn's role token)."""
        tokenizer = self._tokenizer
        if self.family.ends_with_next_header:
            return tokenizer.convert_tokens_to_ids(self.family.end_of_turn[0]), ""
        found = [(after.find(text), text) for text in self.family.end_of_turn if text in after]
        if found:
            at, text = min(found)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == 1:  # a family named for a tokenizer that lacks its tokens falls through to what it has
                return ids[0], after[: at + len(text)]
        specials = set(tokenizer.all_special_ids)
        ids = tokenizer.encode(after, add_special_tokens=False)
        end = next((i for i in ids if i in specials), tokenizer.eos_token_id)
        if end is None:
            raise UpstreamError("the chat template writes no end-of-turn token after a reply, and the model has no eos")
        text = tokenizer.convert_ids_to_tokens(end)
        return end, after[: after.find(text) + len(text)] if text in after else ""

    def render(
        self, messages: Sequence[JsonObject], tools: Sequence[JsonObject] | None, generation_prompt: bool
    ) -> str:
        text = self._tokenizer.apply_chat_template(
            [_with_arguments(message) for message in messages],
            tools=list(tools) if tools else None,
            chat_template=self._chat_template,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **self._options,
        )
        return str(text)

    def prompt(self, messages: Sequence[JsonObject], tools: Sequence[JsonObject] | None) -> list[int]:
        """The ids of a whole conversation, rendered for the model to reply to."""
        return self.encode(self.render(messages, tools, generation_prompt=True))

    def delta(
        self,
        new: Sequence[JsonObject],
        tools: Sequence[JsonObject] | None,
        ended: bool,
        history: Sequence[JsonObject] = (),
    ) -> list[int]:
        """The ids the template writes for `new` messages after a reply (`ended`: whose sampled ids close with an
        end-of-turn token), up to the next reply's generation prompt; `history` is not read: the stand-in stands
        for it. Raises Discontinuity where it cannot say."""
        try:
            after = self.render([*_STAND_IN, *new], tools, generation_prompt=True)
        except TemplateError as e:
            raise Discontinuity(f"the chat template refused the new messages after a reply: {e}") from e
        at = after.find(_ANSWER)
        if at < 0:
            raise Discontinuity("the chat template leaves out a reply that messages follow")
        at += len(_ANSWER)
        if not after.startswith(self._closing, at):
            written = after[at : at + len(self._closing) + 20]
            raise Discontinuity(
                f"the chat template closes a reply with {written!r} once messages follow it, not {self._closing!r}"
            )
        ids = self.encode(after[at + len(self._closing) :])
        return ids if ended or self.family.ends_with_next_header else [self.end_of_turn, *ids]

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            ids: list[int] = self._fast([text], add_special_tokens=False)[0].ids
            return ids
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        if self._decoder is not None:
            return str(self._decoder.decode(plain(ids), skip_special_tokens=False))
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    def difference(self, ids: Sequence[int], messages: Sequence[JsonObject], tools: Any) -> Difference | None:
        """Whether the template's rendering of the whole conversation is the text of `ids`, and where not."""
        try:
            rendered = self.render(messages, tools, generation_prompt=True)
        except TemplateError as e:  # the chat endpoint would refuse the conversation: it differs from its start
            return Difference(0, f"(the chat template refused the conversation: {e})", self.decode(ids[:80])[:80])
        if self._bytes is not None and (joined := text_bytes(self._bytes, ids)) is not None and _same(joined, rendered):
            return None  # the decode of bytes that are the rendering's UTF-8 is the rendering
        sent = self.decode(ids)
        if rendered == sent:
            return None
        at = first_difference(rendered, sent)
        return Difference(at, rendered[at : at + 80], sent[at : at + 80])


def _same(joined: bytes, text: str) -> bool:
    try:
        return joined == text.encode()
    except UnicodeEncodeError:  # a lone surrogate: no decode gives it
        return False


def first_difference(a: str, b: str) -> int:
    """Where two texts first differ (the shorter's length where one begins with the other): compared a block at a
    time in C, then a character at a time within the block that differs, not a character at a time throughout (a
    whole conversation's rendering is some 100,000s of characters)."""
    at, end, block = 0, min(len(a), len(b)), 4096
    while at < end and a[at : at + block] == b[at : at + block]:
        at += block
    if at >= end:
        return end
    return next((i for i in range(at, min(at + block, end)) if a[i] != b[i]), end)


class ChatTemplates:
    """The templates of the models served, each loaded once (off the event loop: loading reads files)."""

    def __init__(self) -> None:
        self._loaded: dict[tuple[str, str | None, str, str | None], ChatTemplate] = {}
        self._lock = threading.Lock()

    def loaded(
        self,
        tokenizer: str,
        chat_template: str | None = None,
        options: JsonObject | None = None,
        family: str | None = None,
    ) -> ChatTemplate | None:
        """The template, if it is loaded already: found without reading a file, so without leaving the event loop."""
        return self._loaded.get((tokenizer, chat_template, repr(sorted((options or {}).items())), family))

    def get(
        self,
        tokenizer: str,
        chat_template: str | None = None,
        options: JsonObject | None = None,
        family: str | None = None,
    ) -> ChatTemplate:
        """The template of the tokenizer at `tokenizer` (a folder or a model name in the local Hugging Face cache),
        as its family's renderer builds it: the family `family` names, else the one its tokenizer says."""
        key = (tokenizer, chat_template, repr(sorted((options or {}).items())), family)
        if (found := self._loaded.get(key)) is not None:
            return found
        with self._lock:
            if (found := self._loaded.get(key)) is None:
                found = self._loaded[key] = renderer(tokenizer, _template(chat_template), options or {}, family)
        return found


def renderer(where: str, chat_template: str | None, options: JsonObject, family: str | None) -> Any:
    """The renderer of the tokenizer at `where` as its family builds it (`family` names it, else its tokenizer
    says), the family's template options under the episode's. A family whose renderer is a package of its own
    (Mistral's, gpt-oss's) is built from `where` without transformers' tokenizer."""
    try:
        chosen = named(family) if family is not None else None
    except ValueError as e:
        raise UpstreamError(f"policy_options.family: {e}") from e
    if chosen is not None and chosen.renderer != "jinja":
        return _own_renderer(chosen, where, options)
    tokenizer = _tokenizer(where)
    if chosen is None:
        chosen = detect(template_text(tokenizer, chat_template), _vocab(tokenizer), options)
    if chosen.renderer != "jinja":
        return _own_renderer(chosen, where, options)
    return ChatTemplate(tokenizer, chat_template, {**chosen.template_kwargs, **options}, chosen)


# A family entry's `renderer` other than `jinja` -> the module that builds it and how. Imported when an episode asks:
# each module imports its family's package (mistral-common, openai-harmony) at its top.
RENDERERS: dict[str, tuple[str, str]] = {
    "mistral": ("proxy.adapters.mistral_template", "load"),
    "harmony": ("proxy.adapters.harmony_template", "HarmonyTemplate"),
}


def _own_renderer(family: Family, where: str, options: JsonObject) -> Any:
    module, name = RENDERERS[family.renderer]
    try:
        build = getattr(importlib.import_module(module), name)  # lazy: its family's package, only when asked for
    except ImportError as e:
        raise UpstreamError(f"family {family.name} needs trajproxy[served] ({e.name} is not installed)") from e
    made = build(where) if family.renderer == "mistral" else build(options.get("reasoning_effort"))
    made.family = family
    return made


def _with_arguments(message: JsonObject) -> JsonObject:
    """A message whose tool calls' arguments are JSON objects rather than text, as vLLM hands them to templates:
    templates that write each argument (XML tool calls) read them as a mapping."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return message
    read = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                value = json.loads(arguments)
            except ValueError:
                value = None
            if isinstance(value, dict):
                call = {**call, "function": {**function, "arguments": value}}  # type: ignore[dict-item]
        read.append(call)
    return {**message, "tool_calls": read}


def template_text(tokenizer: Any, chat_template: str | None) -> str:
    """The chat template a tokenizer renders with: the one given, else its own (a dict of named ones: all of them)."""
    own = chat_template or getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(own.values()) if isinstance(own, dict) else str(own)


def _vocab(tokenizer: Any) -> set[str]:
    return {str(token) for token in tokenizer.get_added_vocab()}


def _tokenizer(where: str) -> Any:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no advice about PyTorch: only the tokenizer is used
    try:
        # lazy: transformers takes seconds to import, and only a tokens-mode policy needs it
        from transformers import AutoTokenizer
    except ImportError as e:
        raise UpstreamError(
            "token in, token out needs the model's tokenizer: pip install 'trajproxy[served]' (transformers)"
        ) from e
    try:
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as e:
        raise UpstreamError(f"the policy's tokenizer could not be loaded from {where!r}: {type(e).__name__}") from e


def _template(chat_template: str | None) -> str | None:
    """A template given inline, or the path of a file holding one."""
    if chat_template is None or "{" in chat_template:
        return chat_template
    try:
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise UpstreamError(f"policy_options.chat_template: no template at {chat_template!r} ({e.strerror})") from e
