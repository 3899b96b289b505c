"""The Dialect interface: how one wire API maps onto the normalised chat turn and back."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from proxy.core.errors import BadRequest
from proxy.core.values import JsonObject, Turn


@dataclass(frozen=True, slots=True)
class Call:
    """An agent's request, parsed: the normalised chat request and how the agent wants its answer."""

    request: JsonObject
    stream: bool
    include_usage: bool = False


class Dialect(Protocol):
    name: str
    keepalive: bytes

    def parse(self, body: JsonObject) -> Call:
        """Normalise a wire body to OpenAI chat shape; raise BadRequest if it is not a valid call."""
        ...

    def render(self, call: Call, turn: Turn) -> bytes:
        """The full (non-streamed) response body for an answered turn."""
        ...

    def render_stream(self, call: Call, turn: Turn) -> list[bytes]:
        """The server-sent events that deliver an answered turn to a streaming agent."""
        ...

    def error_body(self, status: int, kind: str, message: str) -> bytes:
        """An error in the dialect's own shape, as a response body."""
        ...

    def stream_error(self, status: int, kind: str, message: str) -> bytes:
        """An error in the dialect's own shape, as an event in a stream already under way."""
        ...


def messages_of(body: JsonObject) -> list[Any]:
    """The body's `messages`, which both chat-like APIs require to be a non-empty array."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty array of message objects")
    return messages


def check_model(body: JsonObject) -> None:
    """A `model`, if the body names one, is a string without U+0000: it is stored as text (Postgres text cannot
    hold a NUL)."""
    model = body.get("model")
    if model is not None:
        check_model_name(model, "'model'")


def check_model_name(model: Any, where: str) -> None:
    """A model's name, wherever the call gives it (the body, Gemini's path), is `check_model`'s string."""
    if not isinstance(model, str):
        raise BadRequest(f"{where} must be a string, not {type(model).__name__}")
    if "\x00" in model:
        raise BadRequest(f"{where} must not contain U+0000")


def check_id(value: Any, where: str) -> None:
    """Tool call ids are compared and looked up as strings; anything else is refused."""
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"{where} must be a string, not {type(value).__name__}")


def text_field(value: Any, where: str) -> str:
    """A field that must hold text (a block's `text`, say), or BadRequest."""
    if not isinstance(value, str):
        raise BadRequest(f"{where} must be a string, not {type(value).__name__}")
    return value


def arguments_of(function: JsonObject) -> JsonObject:
    """A chat tool call's arguments as the JSON object they encode (Anthropic's `input` and Gemini's `args` are
    objects); text that is not one, under `_raw`. Integers past 64 bits stay as written: orjson reads them as floats
    (and cannot write them), so arguments with such long numbers are read again by the standard library."""
    text = function.get("arguments") or "{}"
    raw = {"_raw": function.get("arguments")}
    try:
        arguments = orjson.loads(text)
    except orjson.JSONDecodeError:
        return raw
    if not isinstance(arguments, dict):
        return raw
    if _LONG_NUMBER.search(text) is None:
        return arguments
    # JSON that orjson read (no NaN, no lone surrogate), though maybe nested deeper than the standard library reads
    try:
        exact: JsonObject = json.loads(text, parse_int=_exact_int)
    except RecursionError:
        return raw
    return exact


_LONG_NUMBER = re.compile(r"\d{19}")  # any integer past 64 bits has as many digits (so do some within)


def _exact_int(digits: str) -> Any:
    """An integer as it was written, where a 64-bit integer cannot hold it (orjson writes a fragment as it is)."""
    return int(digits) if len(digits.lstrip("-")) < 19 else orjson.Fragment(digits)


def agent_env(base_url: str, key: str) -> dict[str, str]:
    """The environment that points an agent's SDKs (OpenAI's, Anthropic's, Google's) at trajproxy with its episode
    key: where each dialect is served under `base_url`."""
    return {
        "OPENAI_BASE_URL": f"{base_url}/v1",
        "OPENAI_API_KEY": key,
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": key,
        "GOOGLE_GEMINI_BASE_URL": base_url,
        "GEMINI_API_KEY": key,
    }
