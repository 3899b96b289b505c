"""Anthropic Messages: `POST /v1/messages` (streamed or not) and `count_tokens`, mapped to the chat turn.

Inbound, messages become OpenAI chat shape: `system` a system message, `tool_use` blocks tool calls,
`tool_result` blocks tool messages, `thinking` blocks the assistant's `reasoning_content` (the blocks
themselves kept under `thinking_blocks`, signatures and all). Outbound, the trainer's chat reply
becomes content blocks, a stop reason and usage, or the event stream Anthropic's SDKs expect.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.core.errors import BadRequest
from proxy.core.values import JsonObject, Turn
from proxy.dialects.dialect import Call, arguments_of, check_id, check_model, messages_of, text_field

STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens", "content_filter": "refusal"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Fields whose meaning is the same in both APIs, under another name.
RENAMED = {"stop_sequences": "stop"}
CONVERTED = {"messages", "system", "tools", "tool_choice", "stop_sequences"}


class AnthropicDialect:
    name = "anthropic"
    keepalive = b'event: ping\ndata: {"type":"ping"}\n\n'

    def parse(self, body: JsonObject) -> Call:
        check_model(body)
        messages = messages_of(body)
        chat: list[JsonObject] = []
        if (system := body.get("system")) is not None:
            chat.append({"role": "system", "content": _system_text(system)})
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest(f"messages.{index}: must be an object with a string 'role' (user or assistant)")
            chat.extend(_to_chat(message, index))
        if not chat:
            raise BadRequest("messages: the conversation is empty (every message has empty content)")
        request = {k: v for k, v in body.items() if k not in CONVERTED}
        request["messages"] = chat
        if (tools := body.get("tools")) is not None:
            if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
                raise BadRequest("tools: must be an array of tool objects")
            request["tools"] = [_tool(tool) for tool in tools]
        if (choice := body.get("tool_choice")) is not None:
            if not isinstance(choice, dict):
                raise BadRequest('tool_choice: must be an object, such as {"type": "auto"}')
            kind = choice.get("type")
            request["tool_choice"] = (
                {"type": "function", "function": {"name": choice.get("name")}}
                if kind == "tool"
                else TOOL_CHOICES.get(str(kind), "auto")
            )
            if choice.get("disable_parallel_tool_use") is True:
                request["parallel_tool_calls"] = False
        for source, target in RENAMED.items():
            if source in body:
                request[target] = body[source]
        return Call(request=request, stream=body.get("stream") is True)

    def render(self, call: Call, turn: Turn) -> bytes:
        return orjson.dumps(self._message(turn, _blocks(turn)))

    def render_stream(self, call: Call, turn: Turn) -> list[bytes]:
        blocks = _blocks(turn)
        start = self._message(turn, [])
        start.update(stop_reason=None, stop_sequence=None)
        start["usage"] = {**start["usage"], "output_tokens": 0}
        events = [_event("message_start", {"type": "message_start", "message": start})]
        for index, block in enumerate(blocks):
            events.extend(_block_events(index, block))
        usage = self._message(turn, [])["usage"]
        delta = {"stop_reason": _stop_reason(turn), "stop_sequence": None}
        events.append(_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
        events.append(_event("message_stop", {"type": "message_stop"}))
        return events

    def error_body(self, status: int, kind: str, message: str) -> bytes:
        return orjson.dumps(_error(kind, message))

    def count_body(self, tokens: int) -> bytes:
        return orjson.dumps({"input_tokens": tokens})

    def stream_error(self, status: int, kind: str, message: str) -> bytes:
        return _event("error", _error(kind, message))

    @staticmethod
    def _message(turn: Turn, content: list[JsonObject]) -> JsonObject:
        usage = turn.reply.usage if turn.reply else None
        return {
            "id": f"msg_{turn.id}",
            "type": "message",
            "role": "assistant",
            "model": turn.model or "trajproxy",
            "content": content,
            "stop_reason": _stop_reason(turn),
            "stop_sequence": None,
            "usage": {
                "input_tokens": usage.prompt_tokens if usage else 0,
                "output_tokens": usage.completion_tokens if usage else 0,
            },
        }


def _system_text(system: Any) -> Any:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return [_part(block) for block in system]
    raise BadRequest("system: must be a string or an array of text blocks")


def _to_chat(message: JsonObject, index: int) -> list[JsonObject]:
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise BadRequest(f"messages.{index}.content: must be a string or an array of content blocks")
    if role == "assistant":
        return [_assistant(content, index)]
    results = [
        _tool_result(block, f"messages.{index}.content.{n}")
        for n, block in enumerate(content)
        if isinstance(block, dict) and block.get("type") == "tool_result"
    ]
    parts = [_part(block) for block in content if not (isinstance(block, dict) and block.get("type") == "tool_result")]
    # The message keeps its own role whatever its content's form: Claude Code sends a mid-conversation `system`
    # message as blocks on one call and as a string on the next, and both must read as the same message.
    return results + ([{"role": role, "content": parts}] if parts else [])


def _assistant(content: list[Any], index: int) -> JsonObject:
    message: JsonObject = {"role": "assistant", "content": None}
    texts: list[JsonObject] = []  # its content as parts: text, and the blocks chat has no word for
    calls, thinking = [], []
    for n, block in enumerate(content):
        if not isinstance(block, dict):
            raise BadRequest(f"messages.{index}.content: each block must be an object")
        kind = block.get("type")
        if kind == "text":
            texts.append(
                {"type": "text", "text": text_field(block.get("text", ""), f"messages.{index}.content.{n}.text")}
            )
        elif kind == "tool_use":
            check_id(block.get("id"), f"messages.{index}.content.{n}.id")
            arguments = orjson.dumps(block.get("input", {})).decode()
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": arguments},
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            thinking.append(block)
        else:  # a hosted tool's use or result (`server_tool_use`, `web_search_tool_result`, ...): kept as it is
            texts.append(block)
    if len(texts) == 1 and texts[0].get("type") == "text":
        message["content"] = texts[0]["text"]  # one text block: the reply as a text, as a chat reply holds it
    elif texts:
        message["content"] = texts  # several blocks: each kept, none joined to the next
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(str(block.get("thinking", "")) for block in thinking)
        message["thinking_blocks"] = thinking
    return message


def _tool_result(block: JsonObject, where: str) -> JsonObject:
    content = block.get("content", "")
    if content is not None and not isinstance(content, str | list):
        raise BadRequest(f"{where}.content must be a string or an array of content blocks")
    check_id(block.get("tool_use_id"), f"{where}.tool_use_id")
    message: JsonObject = {
        "role": "tool",
        "tool_call_id": block.get("tool_use_id"),
        "content": content if isinstance(content, str) else [_part(part) for part in content or ()],
    }
    if block.get("is_error"):
        message["is_error"] = True
    return message


def _part(block: Any) -> JsonObject:
    """One content block as a chat content part; kinds chat has no word for pass through unchanged."""
    if not isinstance(block, dict):
        raise BadRequest("content blocks must be objects")
    if (
        block.get("type") == "image"
        and isinstance(source := block.get("source"), dict)
        and source.get("type") == "base64"
    ):
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
        return {"type": "image_url", "image_url": {"url": url}}
    return block


def _tool(tool: Any) -> JsonObject:
    if not isinstance(tool, dict) or "input_schema" not in tool:
        return {"type": tool.get("type", "custom"), **tool} if isinstance(tool, dict) else {"type": "unknown"}
    function = {"name": tool.get("name")}  # in OpenAI's order: a chat template renders the tools as JSON
    if "description" in tool:
        function["description"] = tool["description"]
    function["parameters"] = tool["input_schema"]
    extras = {k: v for k, v in tool.items() if k not in ("name", "description", "input_schema")}
    return {"type": "function", "function": function, **extras}


def _blocks(turn: Turn) -> list[JsonObject]:
    """The trainer's chat reply as Anthropic content blocks: thinking, then text, then tool uses."""
    assert turn.reply is not None and turn.reply.message is not None
    message = turn.reply.message
    blocks: list[JsonObject] = list(message.get("thinking_blocks") or ())
    if not blocks and message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call.get("function", {})
        arguments = arguments_of(function)
        blocks.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": arguments})
    return blocks


def _block_events(index: int, block: JsonObject) -> list[bytes]:
    kind = block["type"]
    start: JsonObject
    deltas: list[JsonObject]
    if kind == "text":
        start, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": block["text"]}]
    elif kind == "tool_use":
        start = {**block, "input": {}}
        deltas = [{"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}]
    elif kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [{"type": "thinking_delta", "thinking": block.get("thinking", "")}]
        deltas.append({"type": "signature_delta", "signature": block.get("signature", "")})
    else:
        start, deltas = block, []
    events = [_event("content_block_start", {"type": "content_block_start", "index": index, "content_block": start})]
    events += [
        _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}) for d in deltas
    ]
    events.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
    return events


def _stop_reason(turn: Turn) -> str:
    reason = turn.reply.finish_reason if turn.reply else None
    return STOP_REASONS.get(reason or "stop", "end_turn")


def _error(kind: str, message: str) -> JsonObject:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _event(name: str, data: JsonObject) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
