"""The Gemini API: `POST /v1beta/models/{model}:generateContent`, `:streamGenerateContent` and `:countTokens`,
mapped to the chat turn.

Inbound, `contents` become OpenAI chat shape: `systemInstruction` a system message, a `model` turn an assistant
message (its `functionCall` parts tool calls, its `thought` parts `reasoning_content`), `functionResponse` parts
tool messages (the response object as JSON text). A part's `thoughtSignature` is kept verbatim where Google's own
OpenAI-compatible API keeps it, under `extra_content.google.thought_signature` of the tool call (or of the message,
for a signature on another part), and is rendered back onto the part it came with. A user's parts that chat has
no word for (`inlineData`, `fileData`, ...) pass through unchanged. Field names are read in either of the spellings
Google's API reads (`functionCall`, `function_call`). The model and method are named by the path, not the body, so
each call gets a dialect of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core.errors import BadRequest
from proxy.core.values import JsonObject, Turn
from proxy.dialects.dialect import Call, arguments_of, check_id, check_model_name, text_field

FINISH_REASONS = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS", "content_filter": "SAFETY"}
TOOL_MODES = {"AUTO": "auto", "ANY": "required", "NONE": "none", "VALIDATED": "auto"}
# generationConfig fields whose meaning is the same in chat, under another name.
SAMPLING = {
    "temperature": "temperature",
    "topP": "top_p",
    "topK": "top_k",
    "maxOutputTokens": "max_tokens",
    "stopSequences": "stop",
    "seed": "seed",
    "presencePenalty": "presence_penalty",
    "frequencyPenalty": "frequency_penalty",
}
CONVERTED = {"contents", "systemInstruction", "tools", "toolConfig", "generationConfig"}
# Google's status names for HTTP statuses (google.rpc.Code), which its SDKs show and some retry on.
STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    409: "ABORTED",
    410: "FAILED_PRECONDITION",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
METHODS = ("generateContent", "streamGenerateContent", "countTokens")


@dataclass(frozen=True, slots=True)
class GeminiDialect:
    """The dialect of one call: the model and method its path names (streamGenerateContent streams: with
    `?alt=sse` as events, without as one JSON array)."""

    model: str = "trajproxy"
    method: str = "generateContent"
    sse: bool = False
    name = "gemini"
    # Google's SDKs read an event only at the start of their buffer, after optional whitespace: a comment would
    # stall them, a blank line does not.
    keepalive = b"\n"

    @property
    def streaming(self) -> bool:
        return self.method == "streamGenerateContent"

    def parse(self, body: JsonObject) -> Call:
        check_model_name(self.model, "the path's model")  # percent-decoded: `%00` is a U+0000 as in a body's
        if self.method == "countTokens":
            body = _count_request(body)
        contents = body.get("contents")
        if not isinstance(contents, list) or not contents:
            raise BadRequest("'contents' is required and must be a non-empty array of Content objects")
        chat: list[JsonObject] = []
        system = _field(body, "systemInstruction")
        if system is not None:
            chat.append({"role": "system", "content": _system_text(system)})
        for index, content in enumerate(contents):
            chat.extend(_to_chat(content, f"contents.{index}"))
        request: JsonObject = {k: v for k, v in body.items() if _camel(k) not in CONVERTED}
        request["model"] = self.model
        request["messages"] = chat
        if (tools := body.get("tools")) is not None:
            request["tools"] = _tools(tools)
        if (choice := _tool_choice(_field(body, "toolConfig"))) is not None:
            request["tool_choice"] = choice
        request.update(_sampling(_field(body, "generationConfig")))
        return Call(request=request, stream=self.streaming and self.sse)

    def render(self, call: Call, turn: Turn) -> bytes:
        response = self._response(turn)
        return orjson.dumps([response] if self.streaming else response)

    def render_stream(self, call: Call, turn: Turn) -> list[bytes]:
        return [b"data: " + orjson.dumps(self._response(turn)) + b"\r\n\r\n"]

    def error_body(self, status: int, kind: str, message: str) -> bytes:
        return orjson.dumps(_error(status, message))

    def stream_error(self, status: int, kind: str, message: str) -> bytes:
        # Mid-stream, Google sends the error object itself (not an event), which its SDKs raise.
        return orjson.dumps(_error(status, message)) + b"\n"

    def count_body(self, tokens: int) -> bytes:
        return orjson.dumps({"totalTokens": tokens})

    def _response(self, turn: Turn) -> JsonObject:
        assert turn.reply is not None and turn.reply.message is not None
        usage = turn.reply.usage
        reason = FINISH_REASONS.get(turn.reply.finish_reason or "stop", "OTHER")
        candidate = {"content": {"role": "model", "parts": _parts(turn.reply.message)}, "finishReason": reason}
        return {
            "candidates": [{**candidate, "index": 0}],
            "usageMetadata": {
                "promptTokenCount": usage.prompt_tokens if usage else 0,
                "candidatesTokenCount": usage.completion_tokens if usage else 0,
                "totalTokenCount": usage.total_tokens if usage else 0,
            },
            "modelVersion": turn.model or self.model,
            "responseId": turn.id,
        }


def _count_request(body: JsonObject) -> JsonObject:
    """A countTokens body as the generateContent body it counts: `contents`, or a whole `generateContentRequest`."""
    wrapped = _field(body, "generateContentRequest")
    if wrapped is None:
        return body
    if not isinstance(wrapped, dict):
        raise BadRequest("'generateContentRequest' must be a GenerateContentRequest object")
    return wrapped


def _parts_of(content: Any, where: str) -> list[JsonObject]:
    if not isinstance(content, dict):
        raise BadRequest(f"{where}: must be a Content object with 'role' and 'parts'")
    parts = content.get("parts")
    if not isinstance(parts, list) or not all(isinstance(part, dict) for part in parts):
        raise BadRequest(f"{where}.parts: must be an array of Part objects")
    return parts


def _system_text(system: Any) -> Any:
    if isinstance(system, str):
        return system
    parts = _parts_of(system, "systemInstruction")
    if all(set(part) <= {"text"} for part in parts):
        return "".join(text_field(part.get("text", ""), "systemInstruction.parts.text") for part in parts)
    return [_user_part(part) for part in parts]


def _to_chat(content: Any, where: str) -> list[JsonObject]:
    parts = _parts_of(content, where)
    role = content.get("role", "user")
    if role == "model":
        return [_assistant(parts, where)]
    if role not in ("user", "function"):
        raise BadRequest(f"{where}.role: must be 'user' or 'model', not {role!r}")
    results = [
        _tool_result(part, f"{where}.parts.{n}")
        for n, part in enumerate(parts)
        if _field(part, "functionResponse") is not None
    ]
    others = [_user_part(part) for part in parts if _field(part, "functionResponse") is None]
    if not others:
        return results
    if all(part.get("type") == "text" for part in others) and len(others) == 1:
        return [*results, {"role": "user", "content": others[0]["text"]}]
    return [*results, {"role": "user", "content": others}]


def _user_part(part: JsonObject) -> JsonObject:
    """A part as a chat content part: text as text, the rest (inline data, files) unchanged."""
    if set(part) == {"text"}:
        return {"type": "text", "text": text_field(part["text"], "parts.text")}
    if part.get("type") == "text" and not isinstance(part.get("text"), str):
        raise BadRequest("parts.text: a part of type 'text' must have its text, a string")
    return part


def _assistant(parts: list[JsonObject], where: str) -> JsonObject:
    message: JsonObject = {"role": "assistant", "content": None}
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[JsonObject] = []
    signature = None
    for n, part in enumerate(parts):
        if isinstance(call := _field(part, "functionCall"), dict):
            calls.append(_tool_call(call, part, f"{where}.parts.{n}"))
            continue
        if "text" in part:
            text = text_field(part["text"], f"{where}.parts.{n}.text")
            (thoughts if part.get("thought") else texts).append(text)
        signature = _field(part, "thoughtSignature", signature)
    if texts:
        message["content"] = "".join(texts)
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    if signature is not None:
        message["extra_content"] = {"google": {"thought_signature": signature}}
    return message


def _tool_call(call: JsonObject, part: JsonObject, where: str) -> JsonObject:
    check_id(call.get("id"), f"{where}.functionCall.id")
    if not isinstance(call.get("name"), str):
        raise BadRequest(f"{where}.functionCall.name: must be a string")
    arguments = orjson.dumps(call.get("args") or {}).decode()
    tool_call: JsonObject = {"id": call.get("id"), "type": "function"}
    tool_call["function"] = {"name": call["name"], "arguments": arguments}
    if (signature := _field(part, "thoughtSignature")) is not None:
        tool_call["extra_content"] = {"google": {"thought_signature": signature}}
    return tool_call


def _tool_result(part: JsonObject, where: str) -> JsonObject:
    result = _field(part, "functionResponse")
    if not isinstance(result, dict):
        raise BadRequest(f"{where}.functionResponse: must be an object with 'name' and 'response'")
    check_id(result.get("id"), f"{where}.functionResponse.id")
    response = result.get("response", {})
    content = response if isinstance(response, str) else orjson.dumps(response).decode()
    message: JsonObject = {"role": "tool", "tool_call_id": result.get("id"), "content": content}
    if isinstance(name := result.get("name"), str):
        message["name"] = name
    return message


def _tools(tools: Any) -> list[JsonObject]:
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise BadRequest("'tools' must be an array of Tool objects")
    converted: list[JsonObject] = []
    for tool in tools:
        declarations = _field(tool, "functionDeclarations") or []
        if not isinstance(declarations, list):
            raise BadRequest("tools.functionDeclarations: must be an array of FunctionDeclaration objects")
        for declaration in declarations:
            converted.append({"type": "function", "function": _function(declaration)})
        # Google's own tools (googleSearch, codeExecution, ...) pass through under their names.
        converted.extend({"type": kind, kind: value} for kind, value in tool.items() if not kind.startswith("function"))
    return converted


def _function(declaration: Any) -> JsonObject:
    if not isinstance(declaration, dict) or not isinstance(declaration.get("name"), str):
        raise BadRequest("tools.functionDeclarations: each must be an object with a string 'name'")
    function = {"name": declaration["name"]}  # in OpenAI's order: a chat template renders the tools as JSON
    if "description" in declaration:
        function["description"] = declaration["description"]
    parameters = _field(declaration, "parametersJsonSchema", declaration.get("parameters"))
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return function


def _tool_choice(config: Any) -> Any:
    calling = _field(config, "functionCallingConfig") if isinstance(config, dict) else None
    if not isinstance(calling, dict):
        return None
    allowed = _field(calling, "allowedFunctionNames")
    if calling.get("mode") == "ANY" and isinstance(allowed, list) and len(allowed) == 1:
        return {"type": "function", "function": {"name": allowed[0]}}
    return TOOL_MODES.get(str(calling.get("mode")), "auto")


def _sampling(config: Any) -> JsonObject:
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise BadRequest("'generationConfig' must be a GenerationConfig object")
    if _field(config, "candidateCount") not in (None, 1):
        raise BadRequest("only candidateCount=1 is supported: each call is one turn with one reply")
    sampling = {target: value for source, target in SAMPLING.items() if (value := _field(config, source)) is not None}
    rest = {k: v for k, v in config.items() if _camel(k) not in SAMPLING and _camel(k) != "candidateCount"}
    return {**sampling, "generationConfig": rest} if rest else sampling


def _parts(message: JsonObject) -> list[JsonObject]:
    """The trainer's chat reply as Gemini parts: thought, then text, then function calls."""
    parts: list[JsonObject] = []
    signature = ((message.get("extra_content") or {}).get("google") or {}).get("thought_signature")
    if message.get("reasoning_content"):
        parts.append({"text": message["reasoning_content"], "thought": True})
    if message.get("content"):
        parts.append({"text": message["content"]})
    if signature is not None and parts:
        parts[0]["thoughtSignature"] = signature
    for call in message.get("tool_calls") or ():
        function = call.get("function", {})
        arguments = arguments_of(function)
        named = {"id": call["id"]} if call.get("id") is not None else {}
        part: JsonObject = {"functionCall": {**named, "name": function.get("name"), "args": arguments}}
        google = (call.get("extra_content") or {}).get("google") or {}
        if "thought_signature" in google:
            part["thoughtSignature"] = google["thought_signature"]
        parts.append(part)
    return parts


def _field(value: JsonObject, name: str, default: Any = None) -> Any:
    """A field by its JSON name (`functionCall`) or, as Google's API also reads it, its proto name
    (`function_call`, which the Python SDK sends for some fields)."""
    if name in value:
        return value[name]
    return value.get(_UPPER.sub(lambda m: "_" + m.group(0).lower(), name), default)


def _camel(name: str) -> str:
    return _UNDERSCORED.sub(lambda m: m.group(1).upper(), name)


_UPPER = re.compile(r"[A-Z]")
_UNDERSCORED = re.compile(r"_([a-z])")


def _error(status: int, message: str) -> JsonObject:
    return {"error": {"code": status, "message": message, "status": STATUS_NAMES.get(status, "INTERNAL")}}
