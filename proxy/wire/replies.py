"""The trainer's batch of replies as msgspec Structs, decoded straight from the raw body on the hot path (the batch
route and the stream): several times cheaper than the pydantic models in `requests`, which stay the contract.

They accept no more than those models do (tests/test_wire_replies.py checks it on generated bodies): a body they
refuse goes on to the pydantic model, which accepts what is merely unusual (`5.0` for an integer) and answers
the rest with its 422 naming the field; the OpenAPI schema is the pydantic models'.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from proxy.wire.fields import _INT32_MAX, _INT64, _no_nul, _storable, _unicode

_TokenId = Annotated[int, msgspec.Meta(ge=_INT64[0], le=_INT64[1])]
_TokenCount = Annotated[int, msgspec.Meta(ge=0, le=_INT32_MAX)]
_OWN = frozenset({"role", "content", "tool_calls"})  # a message's own fields; the rest go to the agent as they are


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    arguments: str | dict[str, Any] = "{}"

    def __post_init__(self) -> None:
        _storable([self.name, self.arguments])


class ToolCall(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"

    def __post_init__(self) -> None:
        _storable(self.id)


class Usage(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    prompt_tokens: _TokenCount
    completion_tokens: _TokenCount


class AgentError(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    status: Annotated[int, msgspec.Meta(ge=400, le=599)]
    message: str
    type: str = "server_error"

    def __post_init__(self) -> None:
        _storable([self.message, self.type])


class ReplyItem(msgspec.Struct, forbid_unknown_fields=True):
    """`requests.ReplyItem`'s fields; the message stays a dict, as it may carry fields for the agent
    (`reasoning_content`, …), and its tool calls are checked as `ToolCall`s."""

    turn_id: Annotated[str, msgspec.Meta(min_length=1)]
    message: dict[str, Any] | None = None
    error: AgentError | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"] | None = None
    usage: Usage | None = None
    prompt_token_ids: list[_TokenId] | None = None
    completion_token_ids: list[_TokenId] | None = None
    logprobs: list[float] | None = None  # JSON has no NaN or Infinity, and msgspec refuses what overflows
    policy_version: str | None = None
    lease_id: str | None = None

    def __post_init__(self) -> None:
        if (self.message is None) == (self.error is None):
            raise ValueError("a reply carries exactly one of 'message' or 'error'")
        _no_nul(self.turn_id)
        if self.policy_version is not None:
            _no_nul(self.policy_version)
        if self.lease_id is not None:
            _unicode(self.lease_id)
        if self.message is not None:
            self._check_message(self.message)

    def _check_message(self, message: dict[str, Any]) -> None:
        if message.get("role", "assistant") != "assistant":
            raise ValueError("message.role must be 'assistant'")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError("message.content must be a string or null")
        self.tool_calls()
        _storable(message)

    def tool_calls(self) -> list[ToolCall]:
        calls = self.message.get("tool_calls") if self.message is not None else None
        return msgspec.convert(calls, list[ToolCall], strict=True) if calls is not None else []

    def message_for_agent(self) -> dict[str, Any] | None:
        """The message as the pydantic model dumps it (`exclude_none`): its own fields first, the role always, no
        null field at the top."""
        if self.message is None:
            return None
        shaped: dict[str, Any] = {"role": "assistant"}
        known = ((name, self.message.get(name)) for name in ("content", "tool_calls"))
        extra = ((name, value) for name, value in self.message.items() if name not in _OWN)
        shaped.update((name, value) for name, value in (*known, *extra) if value is not None)
        return shaped


class ReplyBatch(msgspec.Struct, forbid_unknown_fields=True):
    replies: Annotated[list[ReplyItem], msgspec.Meta(min_length=1, max_length=4096)]


class StreamReplies(ReplyBatch, forbid_unknown_fields=True):
    id: Annotated[int, msgspec.Meta(ge=0, le=2**53)] | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.id, str):
            _no_nul(self.id)
