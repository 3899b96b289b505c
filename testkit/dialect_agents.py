"""Agents in every dialect, each on its real SDK, running a multi-turn tool-calling episode against a served policy
that samples reasoning and then one call of the tool (tests/test_tokens_mode.py, benchmarks/trainable.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import openai
from google import genai
from google.genai import types

BASH_PARAMETERS: dict[str, object] = {
    "type": "object",
    "properties": {"command": {"type": "string"}},
    "required": ["command"],
}

# The tiny model is random: the server is made to sample reasoning and then one call of the tool (its ids are still
# sampled). The command differs from call to call, so the agent can be seen to get what was sampled.
THINK_THEN_CALL = (
    r'<think>[a-z]{1,6}( [a-z]{1,6}){0,2}</think>\n<tool_call>\n\{"name": "bash", "arguments": '
    r'\{"command": "(ls|pwd|date|whoami)"\}\}\n</tool_call>'
)
SYSTEM, TASK, MORE = "You run commands.", "look around", "carry on"  # MORE: a user turn after the second call
CALLS = 3


def tokens_policy(vllm: Any, mode: str = "tokens", **options: Any) -> dict[str, Any]:
    sampling = {"temperature": 1.0, "seed": 11, "max_tokens": 128, "structured_outputs": {"regex": THINK_THEN_CALL}}
    return {
        "policy": f"vllm:{vllm.served_name}",
        "policy_options": {"api_base": vllm.base_url, "mode": mode, **sampling, **options},
        "turn_timeout_s": 300,  # a busy machine's first call loads the tokenizer and wakes the server
    }


def result_of(command: str) -> str:
    return f"ran {command}: ok"


# Agents: each makes CALLS calls, runs the tool it is asked to, hands back the reply without its reasoning (as most
# agents do), adds a user turn after its second tool result, and returns the tool calls it received, as (name,
# arguments).


def chat_agent(episode: Any, stream: bool) -> list[tuple[str | None, Any]]:
    tools = [{"type": "function", "function": {"name": "bash", "description": "run", "parameters": BASH_PARAMETERS}}]
    history: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    got: list[tuple[str | None, Any]] = []
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        for _ in range(CALLS):
            if stream:
                calls: dict[int, dict[str, str]] = {}
                chunks: Any = client.chat.completions.create(model="p", messages=history, tools=tools, stream=True)  # type: ignore[arg-type]
                for chunk in chunks:
                    for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                        call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                        call["id"] += delta.id or ""
                        call["name"] += (delta.function.name or "") if delta.function else ""
                        call["arguments"] += (delta.function.arguments or "") if delta.function else ""
                (call,) = calls.values()
                content = None
            else:
                message = client.chat.completions.create(model="p", messages=history, tools=tools).choices[0].message  # type: ignore[arg-type]
                (tool,) = message.tool_calls or []
                assert tool.type == "function"
                call = {"id": tool.id, "name": tool.function.name, "arguments": tool.function.arguments}
                content = message.content
            got.append((call["name"], json.loads(call["arguments"])))
            function = {"name": call["name"], "arguments": call["arguments"]}
            history.append(
                {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [{"id": call["id"], "type": "function", "function": function}],
                }
            )
            history.append({"role": "tool", "tool_call_id": call["id"], "content": result_of(got[-1][1]["command"])})
            if len(got) == 2:
                history.append({"role": "user", "content": MORE})
    return got


def responses_agent(episode: Any, stream: bool) -> list[tuple[str | None, Any]]:
    tools = [{"type": "function", "name": "bash", "description": "run", "parameters": BASH_PARAMETERS}]
    items: list[Any] = [{"role": "user", "content": TASK}]
    got: list[tuple[str | None, Any]] = []
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        for _ in range(CALLS):
            asked = {"model": "p", "instructions": SYSTEM, "input": items, "tools": tools}
            if stream:
                events = client.responses.create(**asked, stream=True)  # type: ignore[call-overload]
                output = next(e for e in events if e.type == "response.completed").response.output
            else:
                output = client.responses.create(**asked).output  # type: ignore[call-overload]
            (call,) = [item for item in output if item.type == "function_call"]
            got.append((call.name, json.loads(call.arguments)))
            # the reasoning items are dropped; the call is handed back as it came
            items.append(
                {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
            )
            items.append(
                {"type": "function_call_output", "call_id": call.call_id, "output": result_of(got[-1][1]["command"])}
            )
            if len(got) == 2:
                items.append({"role": "user", "content": MORE})
    return got


def messages_agent(episode: Any, stream: bool) -> list[tuple[str | None, Any]]:
    tools = [{"name": "bash", "description": "run", "input_schema": BASH_PARAMETERS}]
    history: list[Any] = [{"role": "user", "content": TASK}]
    got: list[tuple[str | None, Any]] = []
    with anthropic.Anthropic(base_url=episode.env["ANTHROPIC_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        for _ in range(CALLS):
            asked = {"model": "p", "max_tokens": 256, "system": SYSTEM, "messages": history, "tools": tools}
            if stream:
                with client.messages.stream(**asked) as events:  # type: ignore[arg-type]
                    message = events.get_final_message()
            else:
                message = client.messages.create(**asked)  # type: ignore[call-overload]
            (use,) = [block for block in message.content if block.type == "tool_use"]
            got.append((use.name, use.input))
            kept = [block.model_dump() for block in message.content if block.type != "thinking"]
            history.append({"role": "assistant", "content": kept})
            result = {"type": "tool_result", "tool_use_id": use.id, "content": result_of(str(use.input["command"]))}
            more = [{"type": "text", "text": MORE}] if len(got) == 2 else []
            history.append({"role": "user", "content": [result, *more]})
    return got


def gemini_agent(episode: Any, stream: bool) -> list[tuple[str | None, Any]]:
    options = types.HttpOptions(base_url=episode.env["GOOGLE_GEMINI_BASE_URL"], retry_options=None)
    client = genai.Client(api_key=episode.env["GEMINI_API_KEY"], http_options=options)
    declaration = types.FunctionDeclaration(name="bash", description="run", parameters_json_schema=BASH_PARAMETERS)
    config = types.GenerateContentConfig(
        system_instruction=SYSTEM,
        tools=[types.Tool(function_declarations=[declaration])],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    contents: list[Any] = [types.Content(role="user", parts=[types.Part(text=TASK)])]
    got: list[tuple[str | None, Any]] = []
    try:
        for _ in range(CALLS):
            if stream:
                parts = [
                    part
                    for chunk in client.models.generate_content_stream(model="p", contents=contents, config=config)
                    for part in (
                        chunk.candidates[0].content.parts or []
                        if chunk.candidates and chunk.candidates[0].content
                        else []
                    )
                ]
            else:
                answer = client.models.generate_content(model="p", contents=contents, config=config)
                assert answer.candidates and answer.candidates[0].content
                parts = answer.candidates[0].content.parts or []
            (call,) = [part.function_call for part in parts if part.function_call]
            got.append((call.name, dict(call.args or {})))
            contents.append(types.Content(role="model", parts=[part for part in parts if not part.thought]))
            response = types.FunctionResponse(name="bash", response={"output": result_of(got[-1][1]["command"])})
            more = [types.Part(text=MORE)] if len(got) == 2 else []
            contents.append(types.Content(role="user", parts=[types.Part(function_response=response), *more]))
    finally:
        client.close()
    return got


AGENTS: dict[str, Callable[[Any, bool], list[tuple[str | None, Any]]]] = {
    "chat": chat_agent,
    "responses": responses_agent,
    "messages": messages_agent,
    "gemini": gemini_agent,
}
