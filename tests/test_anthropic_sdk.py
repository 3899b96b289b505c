"""The real `anthropic` SDK through trajproxy: messages (streamed or not, tools, thinking), count_tokens, errors."""

from __future__ import annotations

import threading
import time
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import MessageParam, ThinkingBlockParam

from proxy.client import TrainerClient
from tests.conftest import error_body

TOOLS: list[Any] = [
    {
        "name": "bash",
        "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    }
]
SYSTEM: list[Any] = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]


def agent_for(episode: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=episode.env["ANTHROPIC_BASE_URL"], api_key=episode.key, max_retries=0)


def test_a_tool_conversation_in_messages(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    with agent_for(episode) as client:
        history: list[Any] = [{"role": "user", "content": "How many files?"}]
        first = background(
            client.messages.create, model="claude-x", max_tokens=100, system=SYSTEM, tools=TOOLS, messages=history
        )
        turn = trainer.next_turns(wait_s=5)[0]
        assert turn.dialect == "anthropic"
        assert turn.request["messages"] == [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "How many files?"},
        ]
        assert turn.request["tools"][0]["function"]["parameters"] == TOOLS[0]["input_schema"]
        assert turn.request["max_tokens"] == 100
        assert turn.wire is not None and turn.wire["system"] == SYSTEM  # the body exactly as the agent sent it
        trainer.reply(
            turn.id,
            "Let me look.",
            tool_calls=[{"id": "toolu_1", "function": {"name": "bash", "arguments": {"cmd": "ls"}}}],
        )

        message = first.result(timeout=5)
        assert message.stop_reason == "tool_use"
        assert [block.type for block in message.content] == ["text", "tool_use"]
        tool_use = message.content[1]
        assert (tool_use.id, tool_use.name, tool_use.input) == ("toolu_1", "bash", {"cmd": "ls"})
        assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0

        history += [
            {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a b c"}]},
        ]
        second = background(client.messages.create, model="claude-x", max_tokens=100, tools=TOOLS, messages=history)
        turn = trainer.next_turns(wait_s=5)[0]
        assistant, tool = turn.request["messages"][-2:]
        assert assistant["tool_calls"][0]["id"] == "toolu_1"
        assert assistant["content"] == "Let me look."
        assert tool == {"role": "tool", "tool_call_id": "toolu_1", "content": "a b c"}
        trainer.reply(turn.id, "3 files.")
        final = second.result(timeout=5)
        assert (final.stop_reason, final.content[0].text) == ("end_turn", "3 files.")
        assert [t.dialect for t in trainer.trajectory(episode.id).turns] == ["anthropic", "anthropic"]


@pytest.mark.settings(keepalive_s=0.1)
def test_streaming_with_thinking_and_pings_while_parked(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    thought: ThinkingBlockParam = {"type": "thinking", "thinking": "earlier thought", "signature": "sig-1"}
    history: list[MessageParam] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [thought, {"type": "text", "text": "hello"}]},
        {"role": "user", "content": "and now?"},
    ]

    def stream() -> Any:
        with (
            agent_for(episode) as agent,
            agent.messages.stream(model="claude-x", max_tokens=50, messages=history) as events,
        ):
            return events.get_final_message()

    final = background(stream)
    turn = trainer.next_turns(wait_s=5)[0]
    carried = turn.request["messages"][1]
    assert carried["reasoning_content"] == "earlier thought"
    assert carried["thinking_blocks"] == [thought]
    time.sleep(0.5)  # parked across several ping intervals
    answer = {"content": "now this", "thinking_blocks": [{"type": "thinking", "thinking": "new", "signature": "sig-2"}]}
    trainer.reply(turn.id, message=answer, usage={"prompt_tokens": 12, "completion_tokens": 4})
    message = final.result(timeout=5)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[0].signature) == ("new", "sig-2")
    assert message.content[1].text == "now this"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (12, 4)


@pytest.mark.settings(keepalive_s=0.1)
def test_the_raw_stream_carries_pings_then_the_event_sequence(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    names: list[str] = []

    def agent() -> None:
        with httpx.stream(
            "POST",
            f"{server.url}/v1/messages?beta=true",
            json={"model": "m", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "x"}]},
            headers={"x-api-key": episode.key, "anthropic-version": "2023-06-01"},
            timeout=10,
        ) as response:
            names.extend(line[7:] for line in response.iter_lines() if line.startswith("event: "))

    thread = threading.Thread(target=agent)
    thread.start()
    turn = trainer.next_turns(wait_s=5)[0]
    time.sleep(0.4)
    trainer.reply(turn.id, "ok")
    thread.join(timeout=5)
    first_real = names.index("message_start")
    assert first_real >= 2 and set(names[:first_real]) == {"ping"}
    assert names[first_real:] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_count_tokens_matches_the_usage_replies_carry(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    with agent_for(episode) as client:
        request: dict[str, Any] = {
            "model": "claude-x",
            "system": SYSTEM,
            "tools": TOOLS,
            "messages": [{"role": "user", "content": "count me"}],
        }
        counted = client.messages.count_tokens(**request)
        assert counted.input_tokens > 0
        call = background(client.messages.create, max_tokens=10, **request)
        trainer.reply(trainer.next_turns(wait_s=5)[0].id, "ok")
        assert call.result(timeout=5).usage.input_tokens == counted.input_tokens
        assert len(trainer.trajectory(episode.id).turns) == 1  # counting parks nothing


@pytest.mark.settings(turn_timeout_s=0.5)
def test_errors_come_in_anthropics_shape(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    hello: dict[str, Any] = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    base_url = episode.env["ANTHROPIC_BASE_URL"]
    with (
        anthropic.Anthropic(base_url=base_url, api_key="nope", max_retries=0) as stranger,
        agent_for(episode) as agent,
        anthropic.Anthropic(base_url=base_url, api_key=episode.key) as retrying,  # the SDK's default retries
    ):
        with pytest.raises(anthropic.AuthenticationError) as bad_key:
            stranger.messages.create(**hello)
        assert error_body(bad_key.value.body)["error"]["type"] == "authentication_error"

        with pytest.raises(anthropic.BadRequestError) as malformed:
            agent.messages.create(model="m", max_tokens=5, messages=[])
        assert error_body(malformed.value.body)["type"] == "error"

        with pytest.raises(anthropic.APIStatusError) as timeout:
            retrying.messages.create(**hello)
        assert timeout.value.status_code == 504  # and with the SDK's default retries, still one turn:
        assert len(trainer.trajectory(episode.id).turns) == 1

        trainer.finish(episode.id)
        with pytest.raises(anthropic.APIStatusError) as closed:
            agent.messages.create(**hello)
        assert closed.value.status_code == 410
        assert error_body(closed.value.body)["error"]["type"] == "episode_closed"


# A tool call's arguments as the trainer writes them, and the object an Anthropic or Gemini agent gets (`input`,
# `args`): integers past 64 bits as written; JSON that is not an object comes as text that is not JSON does.
EXACT_ARGUMENTS = [
    (
        '{"account": 123456789012345678901234567890, "ids": [-98765432109876543210, 7]}',
        {"account": 123456789012345678901234567890, "ids": [-98765432109876543210, 7]},
    ),
    ("[1, 2]", {"_raw": "[1, 2]"}),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("arguments", "given"), EXACT_ARGUMENTS)
def test_a_tool_uses_input_is_its_arguments_object_exactly(
    server: Any, trainer: TrainerClient, background: Any, stream: bool, arguments: str, given: Any
) -> None:
    episode = trainer.create_episode()

    def call() -> Any:
        with agent_for(episode) as agent:
            asked: Any = {
                "model": "claude-x",
                "max_tokens": 50,
                "tools": TOOLS,
                "messages": [{"role": "user", "content": "x"}],
            }
            if not stream:
                return agent.messages.create(**asked)
            with agent.messages.stream(**asked) as events:
                return events.get_final_message()

    message = background(call)
    turn = trainer.next_turns(wait_s=5)[0]
    trainer.reply(turn.id, tool_calls=[{"id": "toolu_1", "function": {"name": "bash", "arguments": arguments}}])
    tool_use = message.result(timeout=5).content[0]
    assert (tool_use.type, tool_use.input) == ("tool_use", given)


def test_an_assistant_turn_of_several_blocks_reaches_the_trainer_block_for_block(
    server: Any, trainer: TrainerClient, background: Any
) -> None:
    """An assistant turn a hosted model wrote (text, a web search of its own, more text, a tool use) is not joined
    into one text, nor its hosted tool's blocks dropped; `disable_parallel_tool_use` says no parallel calls."""
    search = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "grep"}}
    found = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}
    history: list[Any] = [
        {"role": "user", "content": "Find it."},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Searching."},
                search,
                found,
                {"type": "text", "text": "Now grep."},
                {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"cmd": "grep -r it"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "here"}]},
    ]
    episode = trainer.create_episode()
    with agent_for(episode) as client:
        asked = background(
            client.messages.create,
            model="claude-x",
            max_tokens=100,
            tools=TOOLS,
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            messages=history,
        )
        turn = trainer.next_turns(wait_s=5)[0]
        trainer.reply(turn.id, "found")
        asked.result(timeout=5)
    assistant = turn.request["messages"][1]
    assert assistant["content"] == [
        {"type": "text", "text": "Searching."},
        search,
        found,
        {"type": "text", "text": "Now grep."},
    ]
    assert [call["id"] for call in assistant["tool_calls"]] == ["toolu_1"]
    assert (turn.request["tool_choice"], turn.request["parallel_tool_calls"]) == ("auto", False)


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("tools", "bash", "tools: must be an array"),
        ("tools", [5], "tools: must be an array"),
        ("tool_choice", "any", "tool_choice: must be an object"),
    ],
)
def test_tools_or_a_tool_choice_of_the_wrong_kind_are_refused_not_dropped(
    server: Any, trainer: TrainerClient, field: str, value: Any, said: str
) -> None:
    episode = trainer.create_episode()
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], field: value}
    with agent_for(episode) as agent, pytest.raises(anthropic.BadRequestError) as refused:
        agent.post("/v1/messages", body=body, cast_to=httpx.Response)
    assert said in error_body(refused.value.body)["error"]["message"]
    assert trainer.trajectory(episode.id).turns == []
