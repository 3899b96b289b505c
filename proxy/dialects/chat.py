"""OpenAI Chat Completions: `POST /v1/chat/completions`, streamed (SSE) or not."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.core.errors import BadRequest
from proxy.core.values import JsonObject, Turn
from proxy.dialects.dialect import Call, check_id, check_model, messages_of

DONE = b"data: [DONE]\n\n"
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # `function`: the API's older tool result


class ChatDialect:
    name = "chat"
    keepalive = b": keep-alive\n\n"

    def parse(self, body: JsonObject) -> Call:
        return self.parse_from(body, 0)

    def parse_from(self, body: JsonObject, first: int) -> Call:
        """`parse`, where the messages before `first` are known to pass its checks (`proxy.http.prefix`)."""
        check_model(body)
        messages = messages_of(body)
        for index in range(first, len(messages)):
            message = messages[index]
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest(f"messages[{index}] must be an object with a string 'role'")
            if message["role"] not in _ROLES:
                raise BadRequest(f"messages[{index}].role must be one of {', '.join(_ROLES)}, not {message['role']!r}")
            if not isinstance(message.get("content"), str | list | None):
                raise BadRequest(f"messages[{index}].content must be a string, an array of content parts or null")
            _check_tool_ids(message, f"messages[{index}]")
        _expect(body, "tools", list, "an array of tool objects")
        if not all(isinstance(tool, dict) for tool in body.get("tools") or ()):
            raise BadRequest("tools must be an array of tool objects")
        _expect(body, "stream", bool, "a boolean")
        _expect(body, "stream_options", dict, "an object")
        if body.get("n") not in (None, 1):
            raise BadRequest("only n=1 is supported: each call is one turn with one reply")
        options = body.get("stream_options") or {}
        return Call(
            request=body,
            stream=bool(body.get("stream")),
            include_usage=bool(options.get("include_usage")),
        )

    def render(self, call: Call, turn: Turn) -> bytes:
        assert turn.reply is not None and turn.reply.message is not None
        return orjson.dumps(
            {
                **_envelope(turn, "chat.completion"),
                "choices": [
                    {
                        "index": 0,
                        "message": _message(turn.reply.message),
                        "logprobs": None,
                        "finish_reason": turn.reply.finish_reason,
                    }
                ],
                "usage": _usage(turn),
            }
        )

    def render_stream(self, call: Call, turn: Turn) -> list[bytes]:
        assert turn.reply is not None and turn.reply.message is not None
        message = _message(turn.reply.message)
        base = _envelope(turn, "chat.completion.chunk")
        if call.include_usage:
            base["usage"] = None

        def chunk(delta: JsonObject, finish_reason: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return _event({**base, "choices": [choice]})

        events = [chunk({"role": "assistant", "content": ""})]
        extras = {k: v for k, v in message.items() if k not in ("role", "content", "tool_calls") and v is not None}
        if extras:
            events.append(chunk(extras))
        if message.get("content"):
            events.append(chunk({"content": message["content"]}))
        for index, call_ in enumerate(message.get("tool_calls") or ()):
            events.append(chunk({"tool_calls": [{"index": index, **call_}]}))
        events.append(chunk({}, turn.reply.finish_reason))
        if call.include_usage:
            events.append(_event({**base, "choices": [], "usage": _usage(turn)}))
        events.append(DONE)
        return events

    def error_body(self, status: int, kind: str, message: str) -> bytes:
        return orjson.dumps(_error(kind, message))

    def stream_error(self, status: int, kind: str, message: str) -> bytes:
        return _event(_error(kind, message))


def _check_tool_ids(message: JsonObject, where: str) -> None:
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise BadRequest(f"{where}.tool_calls must be an array of tool calls")
    for index, call in enumerate(calls or ()):
        if not isinstance(call, dict):
            raise BadRequest(f"{where}.tool_calls[{index}] must be an object")
        check_id(call.get("id"), f"{where}.tool_calls[{index}].id")
    check_id(message.get("tool_call_id"), f"{where}.tool_call_id")


def _expect(body: JsonObject, field: str, kind: type, described: str) -> None:
    value = body.get(field)
    if value is not None and not isinstance(value, kind):
        raise BadRequest(f"'{field}' must be {described}, not {type(value).__name__}")


def _envelope(turn: Turn, kind: str) -> JsonObject:
    return {
        "id": f"chatcmpl-{turn.id}",
        "object": kind,
        "created": int(turn.answered_at or turn.created_at),
        "model": turn.model or "trajproxy",
        "system_fingerprint": None,
    }


def _message(reply: JsonObject) -> JsonObject:
    message: JsonObject = {"role": "assistant", "content": reply.get("content")}
    message.update((k, v) for k, v in reply.items() if k not in ("role", "content", "tool_calls"))
    if reply.get("tool_calls"):
        message["tool_calls"] = reply["tool_calls"]
    return message


def _usage(turn: Turn) -> JsonObject | None:
    usage = turn.reply.usage if turn.reply else None
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def _error(kind: str, message: str) -> JsonObject:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _event(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"
