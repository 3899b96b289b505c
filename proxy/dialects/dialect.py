"""The Dialect interface: how one wire API maps onto the normalised chat turn and back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

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
