"""TiktokenCounter: counts tokens for replies that came without usage; the one module importing tiktoken.

tiktoken downloads its BPE files on first use; on machines without internet it reads them from the
copies litellm ships, found without importing litellm (which would cost seconds of start-up). An encoding is
loaded on first need, not at start: o200k_base costs about 80 MiB and a second to load, and a trainer that sends
usage with its replies never needs one. Until a model's encoding is loaded, `ready` says so, and callers count
off the event loop.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path
from typing import Any

from proxy.core.values import JsonObject

FALLBACK_ENCODING = "o200k_base"
_PER_MESSAGE = 3  # OpenAI's accounting: each message costs a few framing tokens
_REPLY_PRIMER = 3
_MODELS_KEPT = 64  # model names remembered (tiktoken keeps each encoding once, however many names map to it)


def _bundled_bpe_dir() -> str | None:
    spec = importlib.util.find_spec("litellm")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "litellm_core_utils" / "tokenizers"
    return str(folder) if folder.is_dir() else None


class TiktokenCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._encodings: dict[str | None, Any] = {}  # by model name (None: the fallback), newest last
        if "TIKTOKEN_CACHE_DIR" not in os.environ and (bundled := _bundled_bpe_dir()):
            os.environ["TIKTOKEN_CACHE_DIR"] = bundled

    def ready(self, model: object) -> bool:
        """Whether counting for `model` needs no encoding loaded first."""
        return (model if isinstance(model, str) else None) in self._encodings and None in self._encodings

    def count_prompt(self, request: JsonObject) -> int:
        encoding = self._encoding(request.get("model"))
        total = _REPLY_PRIMER
        for message in request.get("messages") or ():
            role = message.get("role") if isinstance(message, dict) else None
            total += _PER_MESSAGE + (len(encoding.encode(role, disallowed_special=())) if isinstance(role, str) else 0)
            total += sum(len(encoding.encode(text, disallowed_special=())) for text in _texts(message))
        for tool in request.get("tools") or ():
            total += sum(len(encoding.encode(text, disallowed_special=())) for text in _texts(tool))
        return total

    def count_completion(self, message: JsonObject) -> int:
        encoding = self._encoding(None)
        return sum(len(encoding.encode(text, disallowed_special=())) for text in _texts(message))

    def _encoding(self, model: object) -> Any:
        name = model if isinstance(model, str) else None
        with self._lock:
            if (encoding := self._encodings.get(name)) is None:
                encoding = self._encodings[name] = _encoding_for(name)
                if len(self._encodings) > _MODELS_KEPT:
                    del self._encodings[next(oldest for oldest in self._encodings if oldest is not None)]
            return encoding


def _encoding_for(model: str | None) -> Any:
    # lazy: imported with the first encoding a reply without usage needs; a trainer that sends usage never loads it
    import tiktoken

    if model:
        try:
            return tiktoken.encoding_for_model(model.rsplit("/", 1)[-1])
        except KeyError:
            pass
    return tiktoken.get_encoding(FALLBACK_ENCODING)


def _texts(value: Any) -> list[str]:
    """Every string inside a message (content parts, tool calls, names), in order."""
    found: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(reversed([v for k, v in item.items() if k not in ("type", "id", "role")]))
        elif isinstance(item, list):
            stack.extend(reversed(item))
    return found
