"""ChatTemplates: a served model's own chat template and tokenizer, as token in, token out needs them; the one module
that imports `transformers`.

A turn that continues its parent is prompted with the parent's prompt ids, the ids the parent sampled, and the
template's tokens for the new messages only. Those are found by rendering the new messages after a stand-in
conversation (a user message and an assistant reply) and keeping what the template writes after the stand-in
reply's end-of-turn token: the same text the template writes there in any conversation, since what it writes for
a message depends on that message and the ones after it, not on the history before it. Where the parent's sampled
ids did not end the turn (cut by `max_tokens`), the end-of-turn token the template would have written comes first.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.core.errors import UpstreamError
from proxy.core.values import JsonObject

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


class ChatTemplate:
    """One model's tokenizer and chat template (with `chat_template`, another template in place of its own)."""

    def __init__(self, tokenizer: Any, chat_template: str | None, options: JsonObject) -> None:
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._options = options  # chat_template_kwargs, e.g. enable_thinking
        closing = self.render([*_STAND_IN], None, generation_prompt=False)
        after = closing[closing.rindex(_ANSWER) + len(_ANSWER) :]
        specials = set(tokenizer.all_special_ids)
        ids = tokenizer.encode(after, add_special_tokens=False)
        end = next((i for i in ids if i in specials), tokenizer.eos_token_id)
        if end is None:
            raise UpstreamError("the chat template writes no end-of-turn token after a reply, and the model has no eos")
        self.end_of_turn: int = end
        self._end_text: str = tokenizer.convert_ids_to_tokens(end)
        # transformers' encode hands even one text to the Rust tokenizer's thread pool (encode_batch), a wake-up of
        # other threads per call; the Rust tokenizer's own encode does the same on this thread. Used only where it
        # neither truncates nor pads, as transformers' encode above has set it.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = backend is not None and backend.truncation is None and backend.padding is None
        self._backend: Any = backend if plain else None

    def render(
        self, messages: Sequence[JsonObject], tools: Sequence[JsonObject] | None, generation_prompt: bool
    ) -> str:
        text = self._tokenizer.apply_chat_template(
            list(messages),
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

    def delta(self, new: Sequence[JsonObject], tools: Sequence[JsonObject] | None, ended: bool) -> list[int] | None:
        """The ids the template writes for `new` messages after a reply (`ended`: whose sampled ids close with the
        end-of-turn token), up to the next reply's generation prompt; None if this template cannot say."""
        before = self.render([*_STAND_IN], tools, generation_prompt=False)
        after = self.render([*_STAND_IN, *new], tools, generation_prompt=True)
        cut = before.find(self._end_text, before.rindex(_ANSWER) + len(_ANSWER))
        if cut < 0:
            return None
        cut += len(self._end_text)
        if after[:cut] != before[:cut]:  # the new messages changed how the stand-in reply is written
            return None
        ids = self.encode(after[cut:])
        return ids if ended else [self.end_of_turn, *ids]

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    def difference(self, ids: Sequence[int], messages: Sequence[JsonObject], tools: Any) -> Difference | None:
        """Whether the template's rendering of the whole conversation is the text of `ids`, and where not."""
        rendered, sent = self.render(messages, tools, generation_prompt=True), self.decode(ids)
        if rendered == sent:
            return None
        at = next(
            (i for i, (a, b) in enumerate(zip(rendered, sent, strict=False)) if a != b), min(len(rendered), len(sent))
        )
        return Difference(at, rendered[at : at + 80], sent[at : at + 80])


class ChatTemplates:
    """The templates of the models served, each loaded once (off the event loop: loading reads files)."""

    def __init__(self) -> None:
        self._loaded: dict[tuple[str, str | None, str], ChatTemplate] = {}
        self._lock = threading.Lock()

    def loaded(
        self, tokenizer: str, chat_template: str | None = None, options: JsonObject | None = None
    ) -> ChatTemplate | None:
        """The template, if it is loaded already: found without reading a file, so without leaving the event loop."""
        return self._loaded.get((tokenizer, chat_template, repr(sorted((options or {}).items()))))

    def get(self, tokenizer: str, chat_template: str | None = None, options: JsonObject | None = None) -> ChatTemplate:
        """The template of the tokenizer at `tokenizer` (a folder or a model name in the local Hugging Face cache)."""
        key = (tokenizer, chat_template, repr(sorted((options or {}).items())))
        if (found := self._loaded.get(key)) is not None:
            return found
        with self._lock:
            if (found := self._loaded.get(key)) is None:
                found = self._loaded[key] = ChatTemplate(_tokenizer(tokenizer), _template(chat_template), options or {})
        return found


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
