"""The trainer's batch of replies as msgspec Structs, decoded straight from the raw body on the hot path (the batch
route and the stream): several times cheaper than the pydantic models in `requests`, which stay the contract.

They accept no more than those models do (tests/test_wire_replies.py checks it on generated bodies), and less
where that keeps them simple: a body they refuse goes on to the pydantic model, which accepts what is merely
unusual (`5.0` for an integer, fields for the agent in a message) and answers the rest with its 422 naming the
field; the OpenAPI schema is the pydantic models'.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from proxy.schema.fields import _INT32_MAX, _INT64, _no_nul, _storable

# msgspec refuses what is not valid Unicode (a lone surrogate, bytes that are not UTF-8) as it decodes: only U+0000,
# which names may not hold, and free-form JSON (integers past 64 bits) are checked here.
_TokenId = Annotated[int, msgspec.Meta(ge=_INT64[0], le=_INT64[1])]
_TokenCount = Annotated[int, msgspec.Meta(ge=0, le=_INT32_MAX)]


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    arguments: str | dict[str, Any] = "{}"

    def __post_init__(self) -> None:
        if not isinstance(self.arguments, str):
            _storable(self.arguments)


class ToolCall(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"
    extra_content: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.extra_content is not None:
            _storable(self.extra_content)


class Message(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The message as most trainers send it. One with fields for the agent beyond these (`reasoning_content`, …)
    is refused here and goes on to the pydantic model, which passes them on."""

    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    role: Literal["assistant"] = "assistant"


class Usage(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    prompt_tokens: _TokenCount
    completion_tokens: _TokenCount


class AgentError(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    status: Annotated[int, msgspec.Meta(ge=400, le=599)]
    message: str
    type: str = "server_error"


class ReplyItem(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """`requests.ReplyItem`'s fields."""

    turn_id: Annotated[str, msgspec.Meta(min_length=1)]
    message: Message | None = None
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

    def message_for_agent(self) -> dict[str, Any] | None:
        """The message as the pydantic model dumps it (`exclude_none`): the role always, no null field."""
        message = self.message
        if message is None:
            return None
        shaped: dict[str, Any] = {"role": "assistant"}
        if message.content is not None:
            shaped["content"] = message.content
        if message.tool_calls is not None:
            shaped["tool_calls"] = message.tool_calls  # replaced with the calls made of them, unless empty
        return shaped


class ReplyBatch(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    replies: Annotated[list[ReplyItem], msgspec.Meta(min_length=1, max_length=4096)]


class StreamReplies(ReplyBatch, forbid_unknown_fields=True, frozen=True):
    id: Annotated[int, msgspec.Meta(ge=0, le=2**53)] | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.id, str):
            _no_nul(self.id)
