"""OpenAI Responses: `POST /v1/responses`, streamed or not, mapped to the chat turn (what the Codex CLI speaks).

Input items become chat messages (`function_call` items tool calls, `function_call_output` items tool
messages, `reasoning` items the assistant's `reasoning_items`); `instructions` a leading system message.
With `previous_response_id`, the earlier turn's conversation and reply are put in front, so the trainer
always sees the whole conversation. The reply becomes output items, or the event stream the SDK expects.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.core.errors import BadRequest
from proxy.core.values import JsonObject, Turn
from proxy.dialects.dialect import Call, check_id, check_model, text_field

CONVERTED = {"input", "tools", "tool_choice", "max_output_tokens"}
RESPONSE_PREFIX = "resp_"


class ResponsesDialect:
    name = "responses"
    keepalive = b": keep-alive\n\n"

    def parse(self, body: JsonObject) -> Call:
        check_model(body)
        items = body.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        if not isinstance(items, list):
            raise BadRequest("'input' is required: a string or an array of input items")
        messages: list[JsonObject] = []
        if isinstance(instructions := body.get("instructions"), str) and instructions:
            messages.append({"role": "system", "content": instructions})
        for index, item in enumerate(items):
            if not isinstance(item, dict):
                raise BadRequest(f"input[{index}] must be an object")
            _add_item(messages, item, f"input[{index}]")
        if not messages and body.get("previous_response_id") is None:
            raise BadRequest("'input' is empty: there is nothing to respond to")
        request = {k: v for k, v in body.items() if k not in CONVERTED}
        request["messages"] = messages
        if (tools := body.get("tools")) is not None:
            if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
                raise BadRequest("'tools' must be an array of tool objects")
            request["tools"] = [_tool(tool) for tool in tools]
        if (choice := body.get("tool_choice")) is not None:
            request["tool_choice"] = (
                {"type": "function", "function": {"name": choice.get("name")}}
                if isinstance(choice, dict) and choice.get("type") == "function"
                else choice
            )
        if "max_output_tokens" in body:
            request["max_tokens"] = body["max_output_tokens"]
        return Call(request=request, stream=body.get("stream") is True)

    @staticmethod
    def previous_turn_id(body: JsonObject) -> str | None:
        previous = body.get("previous_response_id")
        if previous is None:
            return None
        if not isinstance(previous, str) or not previous.startswith(RESPONSE_PREFIX):
            raise BadRequest(f"previous_response_id must be the id of an earlier response ({RESPONSE_PREFIX}…)")
        return previous.removeprefix(RESPONSE_PREFIX)

    @staticmethod
    def continue_from(call: Call, previous: Turn) -> Call:
        """Put the earlier turn's conversation and reply in front of this call's new items."""
        if previous.reply is None or previous.reply.message is None:
            raise BadRequest(f"previous_response_id {RESPONSE_PREFIX}{previous.id} has no reply to continue from")
        history = list(previous.request.get("messages") or ())
        if previous.request.get("instructions") and history and history[0].get("role") == "system":
            history = history[1:]  # instructions apply to one response only
        messages = call.request["messages"]
        lead = 1 if call.request.get("instructions") and messages and messages[0].get("role") == "system" else 0
        merged = [*messages[:lead], *history, previous.reply.message, *messages[lead:]]
        return Call(request={**call.request, "messages": merged}, stream=call.stream)

    def render(self, call: Call, turn: Turn) -> bytes:
        return orjson.dumps(_response(turn, _output(turn), "completed"))

    def render_stream(self, call: Call, turn: Turn) -> list[bytes]:
        events = _Events()
        events.add("response.created", response=_response(turn, [], "in_progress"))
        events.add("response.in_progress", response=_response(turn, [], "in_progress"))
        output = _output(turn)
        for index, item in enumerate(output):
            _item_events(events, index, item)
        final = _response(turn, output, "completed")
        events.add("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
        return events.frames

    def error_body(self, status: int, kind: str, message: str) -> bytes:
        return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}})

    def stream_error(self, status: int, kind: str, message: str) -> bytes:
        error = {"type": "error", "code": kind, "message": message, "param": None, "sequence_number": 0}
        return _frame("error", {**error, "error": {"type": kind, "message": message}})


_OWN_REASONING = "rs_tu_"  # the id `_output` gives a reasoning item it writes from reasoning_content: rs_<turn id>


def _add_item(messages: list[JsonObject], item: JsonObject, where: str) -> None:
    kind = item.get("type", "message")
    if not isinstance(kind, str):
        raise BadRequest(f"{where}.type must be a string, not {kind!r}")
    if kind in ("function_call", "function_call_output"):
        check_id(item.get("call_id"), f"{where}.call_id")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise BadRequest(f"an input message needs a role of user, assistant, system or developer, not {role!r}")
        content = _content(item.get("content"), role, f"{where}.content")
        if role == "assistant" and _opened(messages):  # the text after its reply's reasoning: the same reply
            messages[-1]["content"] = content
        else:
            messages.append({"role": role, "content": content})
    elif kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
        }
        _assistant(messages).setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        output = item.get("output", "")
        if not isinstance(output, str | list):
            raise BadRequest(f"{where}.output must be a string or an array of content parts")
        content = output if isinstance(output, str) else [_part(part) for part in output]
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
    elif kind == "reasoning":
        assistant = _assistant(messages)
        if (text := _rendered_reasoning(item)) is not None and "reasoning_items" not in assistant:
            assistant["reasoning_content"] = assistant.get("reasoning_content", "") + text
        else:
            assistant.setdefault("reasoning_items", []).append(item)
    elif kind == "custom_tool_call":  # a freeform tool's call (the Codex CLI's apply_patch), in chat's custom shape
        check_id(item.get("call_id"), f"{where}.call_id")
        call = {
            "id": item.get("call_id"),
            "type": "custom",
            "custom": {"name": item.get("name"), "input": item.get("input")},
        }
        _assistant(messages).setdefault("tool_calls", []).append(call)
    elif isinstance(kind, str) and kind.endswith("_call_output"):  # what another tool gave back: a tool result
        check_id(item.get("call_id"), f"{where}.call_id")
        output = item.get("output")
        content = output if isinstance(output, str) else [item]
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
    else:  # other items (a built-in tool's call, …): carried unchanged, in the role of whoever made them
        messages.append({"role": "assistant" if str(kind).endswith("_call") else "user", "content": [item]})


def _assistant(messages: list[JsonObject]) -> JsonObject:
    """The assistant message that tool calls and reasoning items attach to: the last, or a new one."""
    if messages and messages[-1].get("role") == "assistant":
        return messages[-1]
    messages.append({"role": "assistant", "content": None})
    return messages[-1]


def _opened(messages: list[JsonObject]) -> bool:
    """Whether the last message is a reply begun by its reasoning alone: no text, no tool call yet."""
    last = messages[-1] if messages else None
    return (
        last is not None
        and last.get("role") == "assistant"
        and last.get("content") is None
        and not last.get("tool_calls")
    )


def _rendered_reasoning(item: JsonObject) -> str | None:
    """The `reasoning_content` a reasoning item was rendered from (`_output`: its id names the turn, its summary the
    text), where it is one such; None for any other (a trainer's own `reasoning_items`, a hosted model's)."""
    summary = item.get("summary")
    if not str(item.get("id", "")).startswith(_OWN_REASONING) or set(item) - {"type", "id", "summary", "status"}:
        return None
    if not isinstance(summary, list) or not all(
        isinstance(part, dict) and part.get("type") == "summary_text" and isinstance(part.get("text"), str)
        for part in summary
    ):
        return None
    return "".join(part["text"] for part in summary)


def _content(content: Any, role: str, where: str) -> Any:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or an array of content parts")
    if role == "assistant" and all(isinstance(p, dict) and p.get("type") == "output_text" for p in content):
        return "".join(text_field(part.get("text", ""), f"{where}[{n}].text") for n, part in enumerate(content))
    return [_part(part) for part in content]


def _part(part: Any) -> Any:
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    if kind == "input_image" and (url := part.get("image_url")):
        return {"type": "image_url", "image_url": {"url": url}}
    return part


def _tool(tool: Any) -> Any:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return tool
    function = {k: v for k, v in tool.items() if k != "type"}
    return {"type": "function", "function": function}


def _output(turn: Turn) -> list[JsonObject]:
    assert turn.reply is not None and turn.reply.message is not None
    message = turn.reply.message
    items: list[JsonObject] = list(message.get("reasoning_items") or ())
    if not items and message.get("reasoning_content"):
        summary = [{"type": "summary_text", "text": message["reasoning_content"]}]
        items.append({"type": "reasoning", "id": f"rs_{turn.id}", "summary": summary})
    if message.get("content"):
        text = {"type": "output_text", "text": message["content"], "annotations": []}
        items.append(
            {"type": "message", "id": f"msg_{turn.id}", "status": "completed", "role": "assistant", "content": [text]}
        )
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function", {})
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{turn.id}_{index}",
                "call_id": call.get("id"),
                "name": function.get("name"),
                "arguments": function.get("arguments", ""),
                "status": "completed",
            }
        )
    return items


def _response(turn: Turn, output: list[JsonObject], status: str) -> JsonObject:
    wire = orjson.loads(bytes(turn.wire)) if turn.wire else {}
    usage = turn.reply.usage if turn.reply else None
    truncated = status == "completed" and turn.reply is not None and turn.reply.finish_reason == "length"
    return {
        "id": f"{RESPONSE_PREFIX}{turn.id}",
        "object": "response",
        "created_at": int(turn.created_at),
        "status": "incomplete" if truncated else status,
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "error": None,
        "model": turn.model or "trajproxy",
        "instructions": wire.get("instructions"),
        "output": output,
        "parallel_tool_calls": wire.get("parallel_tool_calls", True),
        "previous_response_id": wire.get("previous_response_id"),
        "tool_choice": wire.get("tool_choice", "auto"),
        "tools": wire.get("tools", []),
        "temperature": wire.get("temperature"),
        "top_p": wire.get("top_p"),
        "metadata": wire.get("metadata") or {},
        "usage": {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens,
        }
        if usage and status == "completed"
        else None,
    }


def _item_events(events: _Events, index: int, item: JsonObject) -> None:
    where = {"output_index": index, "item_id": item.get("id")}
    if item["type"] == "message":
        events.add(
            "response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []}
        )
        for part_index, part in enumerate(item["content"]):
            at = {**where, "content_index": part_index}
            events.add("response.content_part.added", **at, part={**part, "text": ""})
            events.add("response.output_text.delta", **at, delta=part["text"], logprobs=[])
            events.add("response.output_text.done", **at, text=part["text"], logprobs=[])
            events.add("response.content_part.done", **at, part=part)
    elif item["type"] == "function_call":
        events.add(
            "response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}
        )
        events.add("response.function_call_arguments.delta", **where, delta=item["arguments"])
        events.add("response.function_call_arguments.done", **where, arguments=item["arguments"], name=item["name"])
    else:
        events.add("response.output_item.added", output_index=index, item=item)
    events.add("response.output_item.done", output_index=index, item=item)


class _Events:
    """Server-sent events numbered in order, as the Responses stream numbers them."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def add(self, kind: str, **data: Any) -> None:
        self.frames.append(_frame(kind, {"type": kind, "sequence_number": len(self.frames), **data}))


def _frame(kind: str, data: JsonObject) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
