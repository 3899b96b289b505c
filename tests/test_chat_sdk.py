"""The real `openai` SDK (sync, async, streaming, tools) holds multi-turn conversations through trajproxy."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionFunctionToolParam

from proxy.client import AsyncTrainerClient, TrainerClient

TOOLS: list[ChatCompletionFunctionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        },
    }
]


def agent_for(episode: Any, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0, **kwargs)


def run_tool_loop(episode: Any, *, stream: bool) -> list[Any]:
    """A tiny agent of the episode: ask, run the requested 'tool', send its output back, until the model stops."""
    with agent_for(episode) as client:
        messages: list[Any] = [{"role": "user", "content": "How many files are there?"}]
        finals = []
        for _ in range(4):
            if stream:
                chunks = list(
                    client.chat.completions.create(
                        model="policy",
                        messages=messages,
                        tools=TOOLS,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
                message, finish_reason = assemble(chunks)
                assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
            else:
                completion = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
                message = completion.choices[0].message.model_dump(exclude_none=True)
                finish_reason = completion.choices[0].finish_reason
                assert completion.usage is not None and completion.usage.prompt_tokens > 0
            finals.append((message, finish_reason))
            messages.append(message)
            if finish_reason != "tool_calls":
                return finals
            for call in message["tool_calls"]:
                cmd = json.loads(call["function"]["arguments"])["cmd"]
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"ran {cmd}: 3 files"})
        raise AssertionError("the conversation did not end")


def assemble(chunks: list[Any]) -> tuple[dict[str, Any], str | None]:
    """Rebuild the assistant message from streamed deltas, as agents do."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    finish_reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                slot = calls.setdefault(
                    call.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                slot["id"] += call.id or ""
                slot["function"]["name"] += (call.function.name or "") if call.function else ""
                slot["function"]["arguments"] += (call.function.arguments or "") if call.function else ""
            finish_reason = choice.finish_reason or finish_reason
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    return message, finish_reason


def answer_tool_loop(trainer: TrainerClient, episode_id: str) -> list[Any]:
    """The trainer's side: a tool call first, then a final answer once it sees the tool's output."""
    seen = []
    first = trainer.next_turns(episode=episode_id, wait_s=10)[0]
    seen.append(first)
    trainer.reply(
        first.id,
        tool_calls=[{"id": "call_1", "function": {"name": "bash", "arguments": {"cmd": "ls | wc -l"}}}],
        lease_id=first.lease_id,
    )
    second = trainer.next_turns(episode=episode_id, wait_s=10)[0]
    seen.append(second)
    trainer.reply(second.id, "There are 3 files.", lease_id=second.lease_id)
    return seen


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_sync_sdk_tool_conversation(server: Any, trainer: TrainerClient, background: Any, stream: bool) -> None:
    episode = trainer.create_episode(task="count files")
    agent = background(run_tool_loop, episode, stream=stream)
    seen = answer_tool_loop(trainer, episode.id)
    finals = agent.result(timeout=10)

    assert [reason for _, reason in finals] == ["tool_calls", "stop"]
    first_call = finals[0][0]["tool_calls"][0]
    assert first_call["id"] == "call_1"
    assert json.loads(first_call["function"]["arguments"]) == {"cmd": "ls | wc -l"}
    assert finals[1][0]["content"] == "There are 3 files."

    # The trainer observed the conversation growing, tool result included, in chat shape.
    assert seen[0].request["messages"] == [{"role": "user", "content": "How many files are there?"}]
    assert seen[0].request["tools"] == TOOLS
    assert seen[0].request.get("stream", False) is stream
    tool_message = seen[1].request["messages"][-1]
    assert tool_message == {"role": "tool", "tool_call_id": "call_1", "content": "ran ls | wc -l: 3 files"}

    recorded = trainer.trajectory(episode.id)
    assert recorded.episode.status == "running"
    assert [(turn.seq, turn.status, turn.stream) for turn in recorded.turns] == [
        (0, "answered", stream),
        (1, "answered", stream),
    ]
    assert recorded.turns[0].reply is not None and recorded.turns[0].reply.finish_reason == "tool_calls"
    assert recorded.turns[1].reply is not None and recorded.turns[1].reply.message == {
        "role": "assistant",
        "content": "There are 3 files.",
    }
    assert all(turn.reply and turn.reply.usage and turn.reply.usage.prompt_tokens > 0 for turn in recorded.turns)


def test_async_sdk_many_episodes_with_async_trainer(server: Any) -> None:
    """Eight agents on AsyncOpenAI, streaming and not, answered by one AsyncTrainerClient pulling in batches."""

    async def agent(env: dict[str, str], key: str, index: int) -> str:
        async with openai.AsyncOpenAI(base_url=env["OPENAI_BASE_URL"], api_key=key, max_retries=0) as client:
            history: list[Any] = [{"role": "user", "content": f"agent {index}"}]
            for step in range(3):
                if index % 2:
                    stream = await client.chat.completions.create(model="m", messages=history, stream=True)
                    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
                else:
                    completion = await client.chat.completions.create(model="m", messages=history)
                    text = completion.choices[0].message.content or ""
                history += [{"role": "assistant", "content": text}, {"role": "user", "content": f"step {step}"}]
            return text

    async def trainer_loop(client: AsyncTrainerClient, expected: int) -> int:
        answered = 0
        while answered < expected:
            for turn in await client.next_turns(max=16, wait_s=5):
                last = turn.request["messages"][-1]["content"]
                await client.reply(turn.id, f"echo {last}", lease_id=turn.lease_id)
                answered += 1
        return answered

    async def main() -> None:
        async with AsyncTrainerClient(server.url, server.token) as client:
            episodes = [await client.create_episode(task=f"t{i}") for i in range(8)]
            results = await asyncio.wait_for(
                asyncio.gather(
                    trainer_loop(client, 8 * 3),
                    *(agent(ep.env, ep.key, i) for i, ep in enumerate(episodes)),
                ),
                timeout=30,
            )
            assert results[0] == 24
            assert results[1:] == ["echo step 1"] * 8
            for episode in episodes:
                recorded = await client.trajectory(episode.id)
                assert [turn.seq for turn in recorded.turns] == [0, 1, 2]
                assert {turn.status for turn in recorded.turns} == {"answered"}

    asyncio.run(main())


def test_unknown_fields_reach_the_trainer_verbatim(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    extra = {"reasoning_effort": "high", "provider_specific_fields": {"x": [1, 2]}, "future_field": None}
    with agent_for(episode) as agent:
        call = background(
            agent.chat.completions.create,
            model="gpt-5",
            messages=[
                {"role": "system", "content": "s", "cache_control": {"type": "ephemeral"}},
                {"role": "user", "content": "u"},
            ],
            extra_body=extra,
            metadata={"run": "7"},
        )
        turn = trainer.next_turns(wait_s=5)[0]
        for name, value in extra.items():
            assert turn.request[name] == value
        assert turn.request["metadata"] == {"run": "7"}
        assert turn.request["messages"][0]["cache_control"] == {"type": "ephemeral"}
        trainer.reply(turn.id, "ok")
        assert call.result(timeout=5).choices[0].message.content == "ok"


def test_episode_key_in_the_path_for_agents_that_force_their_own_key(
    server: Any, trainer: TrainerClient, background: Any
) -> None:
    episode = trainer.create_episode()
    with openai.OpenAI(
        base_url=f"{server.url}/e/{episode.key}/v1", api_key="sk-agent-forces-this", max_retries=0
    ) as client:
        call = background(client.chat.completions.create, model="m", messages=[{"role": "user", "content": "hi"}])
        turn = trainer.next_turns(wait_s=5)[0]
        assert turn.episode_id == episode.id
        trainer.reply(turn.id, "hello")
        assert call.result(timeout=5).choices[0].message.content == "hello"
        assert [model.id for model in client.models.list()] == ["trajproxy"]


def test_trainer_extras_are_recorded_and_usage_is_passed_through(
    server: Any, trainer: TrainerClient, background: Any
) -> None:
    episode = trainer.create_episode()
    with agent_for(episode) as agent:
        call = background(agent.chat.completions.create, model="m", messages=[{"role": "user", "content": "hi"}])
        turn = trainer.next_turns(wait_s=5)[0]
        trainer.reply(
            turn.id,
            "abc",
            finish_reason="length",
            usage={"prompt_tokens": 11, "completion_tokens": 3},
            prompt_token_ids=[1, 2, 3],
            completion_token_ids=[7, 8, 9],
            logprobs=[-0.5, -0.25, -0.125],
            policy_version="step-42",
        )
        completion = call.result(timeout=5)
        assert completion.choices[0].finish_reason == "length"
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (
            11,
            3,
            14,
        )
        reply = trainer.trajectory(episode.id).turns[0].reply
        assert reply is not None
        assert reply.completion_token_ids == [7, 8, 9]
        assert reply.prompt_token_ids == [1, 2, 3]
        assert reply.logprobs == [-0.5, -0.25, -0.125]
        assert reply.policy_version == "step-42"


def test_litellm_as_a_client_through_the_openai_provider(server: Any, trainer: TrainerClient, background: Any) -> None:
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    episode = trainer.create_episode()
    options = {"api_base": episode.env["OPENAI_BASE_URL"], "api_key": episode.key, "num_retries": 0}
    call = background(
        litellm.completion, model="openai/policy", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, **options
    )
    turn = trainer.next_turns(wait_s=10)[0]
    assert turn.request["model"] == "policy"
    trainer.reply(turn.id, tool_calls=[{"id": "call_l", "function": {"name": "bash", "arguments": {"cmd": "ls"}}}])
    response = call.result(timeout=10)
    assert response.choices[0].message.tool_calls[0].function.name == "bash"
    assert response.usage.total_tokens > 0

    streamed = background(
        lambda: "".join(
            chunk.choices[0].delta.content or ""
            for chunk in litellm.completion(
                model="openai/policy", messages=[{"role": "user", "content": "again"}], stream=True, **options
            )
        )
    )
    trainer.reply(trainer.next_turns(wait_s=10)[0].id, "streamed back")
    assert streamed.result(timeout=10) == "streamed back"
