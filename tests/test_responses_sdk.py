"""The real `openai` SDK's Responses API through trajproxy: input items, function tools, previous_response_id,
streamed and not."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from proxy.client import TrainerClient

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "shell",
        "description": "Run a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        "strict": False,
    }
]


def agent_for(episode: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0)


SHELL_LS = {"id": "call_9", "type": "function", "function": {"name": "shell", "arguments": '{"cmd":"ls"}'}}


def call_shell(trainer: TrainerClient, call_id: str = "call_9") -> Any:
    turn = trainer.next_turns(wait_s=5)[0]
    trainer.reply(turn.id, tool_calls=[{"id": call_id, "function": {"name": "shell", "arguments": {"cmd": "ls"}}}])
    return turn


def test_function_calls_round_trip_with_instructions(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    with agent_for(episode) as client:
        first = background(
            client.responses.create, model="gpt-5", instructions="Be brief.", input="List files.", tools=TOOLS
        )
        turn = call_shell(trainer)
        assert turn.dialect == "responses"
        assert turn.request["messages"] == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "List files."},
        ]
        assert turn.request["tools"][0] == {
            "type": "function",
            "function": {k: v for k, v in TOOLS[0].items() if k != "type"},
        }
        response = first.result(timeout=5)
        [call] = response.output
        assert (call.type, call.call_id, call.name, json.loads(call.arguments)) == (
            "function_call",
            "call_9",
            "shell",
            {"cmd": "ls"},
        )
        assert response.usage is not None and response.usage.input_tokens > 0

        # The agent sends the whole conversation back as items, as Codex does without storage.
        items: list[Any] = [
            {"role": "user", "content": [{"type": "input_text", "text": "List files."}]},
            {"type": "function_call", "call_id": "call_9", "name": "shell", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": "call_9", "output": "a.txt b.txt"},
        ]
        second = background(client.responses.create, model="gpt-5", instructions="Be brief.", input=items, tools=TOOLS)
        turn = trainer.next_turns(wait_s=5)[0]
        assistant, tool = turn.request["messages"][2:]
        assert assistant["tool_calls"][0]["id"] == "call_9"
        assert tool == {"role": "tool", "tool_call_id": "call_9", "content": "a.txt b.txt"}
        assert turn.request["messages"][1] == {"role": "user", "content": [{"type": "text", "text": "List files."}]}
        trainer.reply(turn.id, "Two files.")
        assert second.result(timeout=5).output_text == "Two files."


@pytest.mark.parametrize("reasoning", ["reasoning_content", "reasoning_items"])
def test_a_reply_sent_back_as_its_output_items_is_the_one_reply_it_was(
    server: Any, trainer: TrainerClient, background: Any, reasoning: str
) -> None:
    """Codex without storage sends the reply's output items back as they came (reasoning, message, function call):
    the trainer's next turn holds the reply as it was given, one assistant message, its reasoning as it was."""
    episode = trainer.create_episode()
    given: dict[str, Any] = {"content": "Let me look.", "tool_calls": [SHELL_LS]}
    if reasoning == "reasoning_content":
        given["reasoning_content"] = "I should run ls."
    else:
        given["reasoning_items"] = [{"type": "reasoning", "id": "rs_9", "summary": [], "encrypted_content": "e0"}]
    with agent_for(episode) as client:
        first = background(client.responses.create, model="gpt-5", input="List files.", tools=TOOLS, store=False)
        answered = trainer.reply(trainer.next_turns(wait_s=5)[0].id, message=given)
        output = first.result(timeout=5).output
        assert [item.type for item in output] == ["reasoning", "message", "function_call"]
        items: list[Any] = [{"role": "user", "content": "List files."}]
        items += [item.model_dump(exclude_none=True) for item in output]
        items.append({"type": "function_call_output", "call_id": "call_9", "output": "a.txt"})
        second = background(client.responses.create, model="gpt-5", input=items, tools=TOOLS, store=False)
        turn = trainer.next_turns(wait_s=5)[0]
        trainer.reply(turn.id, "Two files.")
        second.result(timeout=5)
    assert answered.reply is not None and answered.reply.message is not None
    reply = {k: v for k, v in answered.reply.message.items() if v is not None}
    _, assistant, tool = turn.request["messages"]
    assert assistant == reply, assistant
    assert tool == {"role": "tool", "tool_call_id": "call_9", "content": "a.txt"}


def test_previous_response_id_rebuilds_the_conversation(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    with agent_for(episode) as client:
        first = background(client.responses.create, model="m", instructions="Old rules.", input="Run ls.", tools=TOOLS)
        call_shell(trainer, "call_a")
        response = first.result(timeout=5)

        follow_up: list[Any] = [{"type": "function_call_output", "call_id": "call_a", "output": "x y"}]
        second = background(
            client.responses.create,
            model="m",
            instructions="New rules.",
            input=follow_up,
            previous_response_id=response.id,
        )
        turn = trainer.next_turns(wait_s=5)[0]
        assert [m["role"] for m in turn.request["messages"]] == ["system", "user", "assistant", "tool"]
        assert turn.request["messages"][0]["content"] == "New rules."  # instructions do not carry over
        assert turn.request["messages"][2]["tool_calls"][0]["id"] == "call_a"
        trainer.reply(turn.id, "done")
        assert second.result(timeout=5).output_text == "done"

        other = trainer.create_episode()
        # another episode's responses are not yours to continue
        with agent_for(other) as stranger, pytest.raises(openai.NotFoundError):
            stranger.responses.create(model="m", input="hi", previous_response_id=response.id)


def test_streaming_emits_the_event_sequence(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()

    def stream() -> tuple[list[str], Any]:
        kinds: list[str] = []
        with agent_for(episode) as agent, agent.responses.stream(model="m", input="hi", tools=TOOLS) as events:
            for event in events:
                kinds.append(event.type)
            return kinds, events.get_final_response()

    result = background(stream)
    turn = trainer.next_turns(wait_s=5)[0]
    trainer.reply(
        turn.id, "Checking.", tool_calls=[{"id": "call_s", "function": {"name": "shell", "arguments": '{"cmd":"pwd"}'}}]
    )
    kinds, final = result.result(timeout=5)
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert final.output_text == "Checking."
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[1].call_id == "call_s"


def test_bad_input_is_refused_in_openai_shape(server: Any, trainer: TrainerClient) -> None:
    with agent_for(trainer.create_episode()) as client:
        with pytest.raises(openai.BadRequestError, match="input"):
            client.responses.create(model="m", input=42)  # type: ignore[call-overload]  # the wrong type, on purpose
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            client.responses.create(model="m", input="x", previous_response_id="nope")
        with pytest.raises(openai.BadRequestError, match="'tools' must be an array of tool objects"):
            client.responses.create(model="m", input="x", tools="shell")  # type: ignore[arg-type]  # on purpose
        with pytest.raises(openai.BadRequestError, match=r"input\[0\]\.type must be a string"):
            client.responses.create(model="m", input=[{"type": None, "content": "x"}])  # type: ignore[list-item]
