"""Lossless round trips: a chat reply, rendered in the agent's dialect and sent back in its next request, is the
same chat message the trainer recorded; in every dialect, streamed or not."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anthropic
import openai
import pytest
from pydantic import BaseModel

from proxy.client import TrainerClient

REPLY: dict[str, Any] = {
    "content": "Let me check two things.",
    "tool_calls": [
        {"id": "call_a1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls -la"}'}},
        {"id": "call_b2", "type": "function", "function": {"name": "read", "arguments": '{"path": "é/ü.txt"}'}},
    ],
}


def echo_chat(client: openai.OpenAI, stream: bool) -> list[Any]:
    messages: list[Any] = [{"role": "user", "content": "go"}]
    if stream:
        calls: dict[int, Any] = {}
        content = ""
        for chunk in client.chat.completions.create(model="m", messages=messages, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or ():
                    calls[call.index] = call.model_dump(exclude_none=True, exclude={"index"})
        message = {"role": "assistant", "content": content, "tool_calls": [calls[i] for i in sorted(calls)]}
    else:
        message = (
            client.chat.completions.create(model="m", messages=messages)
            .choices[0]
            .message.model_dump(exclude_none=True)
        )
    return [*messages, message, *tool_results(REPLY["tool_calls"])]


def echo_anthropic(client: anthropic.Anthropic, stream: bool) -> list[Any]:
    messages: list[Any] = [{"role": "user", "content": "go"}]
    content: Sequence[BaseModel]  # the SDK's content blocks, parsed or not
    if stream:
        with client.messages.stream(model="m", max_tokens=50, messages=messages) as events:
            content = events.get_final_message().content
    else:
        content = client.messages.create(model="m", max_tokens=50, messages=messages).content
    results = [{"type": "tool_result", "tool_use_id": c["id"], "content": "ok"} for c in REPLY["tool_calls"]]
    assistant = {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in content]}
    return [*messages, assistant, {"role": "user", "content": results}]


def echo_responses(client: openai.OpenAI, stream: bool) -> list[Any]:
    items: list[Any] = [{"role": "user", "content": "go"}]
    output: Sequence[BaseModel]  # the SDK's output items, parsed or not
    if stream:
        with client.responses.stream(model="m", input=items) as events:
            output = events.get_final_response().output
    else:
        output = client.responses.create(model="m", input=items).output
    echoed = [item.model_dump(exclude_none=True) for item in output]
    outputs = [{"type": "function_call_output", "call_id": c["id"], "output": "ok"} for c in REPLY["tool_calls"]]
    return [*items, *echoed, *outputs]


def tool_results(calls: list[Any]) -> list[Any]:
    return [{"role": "tool", "tool_call_id": call["id"], "content": "ok"} for call in calls]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("dialect", ["chat", "anthropic", "responses"])
def test_the_reply_comes_back_unchanged(
    server: Any, trainer: TrainerClient, background: Any, dialect: str, stream: bool
) -> None:
    episode = trainer.create_episode()
    if dialect == "anthropic":
        agent: Any = anthropic.Anthropic(base_url=episode.env["ANTHROPIC_BASE_URL"], api_key=episode.key, max_retries=0)
        echo: Any = echo_anthropic
    else:
        agent = openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0)
        echo = echo_chat if dialect == "chat" else echo_responses
    with agent:
        first = background(echo, agent, stream)
        turn = trainer.next_turns(wait_s=5)[0]
        recorded = trainer.reply(turn.id, message=REPLY).reply
        assert recorded is not None and recorded.message is not None
        history = first.result(timeout=10)

        if dialect == "anthropic":
            follow_up = background(agent.messages.create, model="m", max_tokens=50, messages=history)
        elif dialect == "responses":
            follow_up = background(agent.responses.create, model="m", input=history)
        else:
            follow_up = background(agent.chat.completions.create, model="m", messages=history)
        again = trainer.next_turns(wait_s=5)[0]
        messages = again.request["messages"]
        assistant = next(m for m in messages if m["role"] == "assistant")
        assert assistant["content"] == recorded.message["content"]
        assert assistant["tool_calls"] == recorded.message["tool_calls"]
        assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == ["call_a1", "call_b2"]
        trainer.reply(again.id, "done")
        follow_up.result(timeout=10)
