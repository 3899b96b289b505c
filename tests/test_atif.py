"""`trajproxy export --shape atif`: what a real `openai` SDK agent did, as Agent Trajectory Interchange Format v1.7
trajectories, each line validated by the `atif` package's models of the RFC (sequential steps, agent-only fields,
tool call and observation pairs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import atif
import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletionFunctionToolParam

from proxy.client import TrainerClient
from tests.test_export import lines_of

TOOLS: list[ChatCompletionFunctionToolParam] = [
    {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}}}
]
SYSTEM = {"role": "system", "content": "You are a careful agent."}


def agent(episode: Any) -> None:
    """One conversation with a tool call and its result, then a second, unrelated question (a new branch)."""
    with openai.OpenAI(
        base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0, timeout=30
    ) as client:
        messages: list[Any] = [SYSTEM, {"role": "user", "content": "How many files are there?"}]
        first = client.chat.completions.create(model="policy-7b", messages=messages, tools=TOOLS).choices[0].message
        messages += [first.model_dump(exclude_none=True)]
        assert first.tool_calls is not None
        messages += [{"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "3 files"}]
        client.chat.completions.create(model="policy-7b", messages=messages, tools=TOOLS)
        client.chat.completions.create(model="policy-7b", messages=[{"role": "user", "content": "Name a colour."}])


@pytest.fixture
def recorded(server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]) -> dict[str, Any]:
    episode = trainer.create_episode(task="count the files", metadata={"agent": {"name": "tiny", "version": "1.2"}})
    running = background(agent, episode)
    replies: list[dict[str, Any]] = [  # reply bodies, as JSON
        {
            "message": {"content": "Let me look.", "tool_calls": [_call("call_1", "bash", {"cmd": "ls"})]},
            "usage": {"prompt_tokens": 30, "completion_tokens": 7},
            "prompt_token_ids": [1, 2, 3],
            "completion_token_ids": [40, 41],
            "logprobs": [-0.5, -0.25],
        },
        {"message": {"content": "There are 3 files."}, "usage": {"prompt_tokens": 50, "completion_tokens": 6}},
        {"message": {"content": "Blue."}, "usage": {"prompt_tokens": 8, "completion_tokens": 2}},
    ]
    for reply in replies:
        [turn] = trainer.next_turns(episode=episode.id, max=1, wait_s=20)
        trainer.reply(turn.id, lease_id=turn.lease_id, **reply)
    running.result(timeout=30)
    trainer.add_reward(episode.id, 1.0)
    trainer.add_reward(episode.id, 0.5, "style")
    trainer.finish(episode.id)
    return {"url": server.settings.database_url, "episode": episode}


def test_each_branch_is_a_valid_atif_trajectory_of_what_was_recorded(recorded: dict[str, Any], tmp_path: Path) -> None:
    lines = lines_of(recorded["url"], tmp_path, "--shape", "atif")
    trajectories = [atif.Trajectory.model_validate(line) for line in lines]  # the RFC's own rules, or it raises
    assert [t.trajectory_id for t in trajectories] == [f"{recorded['episode'].id}/0", f"{recorded['episode'].id}/1"]
    tool_use, colour = lines
    assert tool_use["schema_version"] == "ATIF-v1.7" and tool_use["session_id"] == recorded["episode"].id
    assert tool_use["agent"] == {"name": "tiny", "version": "1.2", "model_name": "policy-7b", "tool_definitions": TOOLS}
    assert [step["source"] for step in tool_use["steps"]] == ["system", "user", "agent", "agent"]
    assert [step["step_id"] for step in tool_use["steps"]] == [1, 2, 3, 4]
    called, answered = tool_use["steps"][2:]
    assert called["message"] == "Let me look."
    assert called["tool_calls"] == [{"tool_call_id": "call_1", "function_name": "bash", "arguments": {"cmd": "ls"}}]
    assert called["observation"] == {"results": [{"source_call_id": "call_1", "content": "3 files"}]}
    metrics = called["metrics"]
    assert (metrics["prompt_tokens"], metrics["completion_tokens"]) == (30, 7)
    assert (metrics["prompt_token_ids"], metrics["completion_token_ids"]) == ([1, 2, 3], [40, 41])
    assert metrics["logprobs"] == [-0.5, -0.25] and metrics["extra"]["answered_by"] == "trainer"
    assert answered["message"] == "There are 3 files." and "observation" not in answered
    assert called["timestamp"] <= answered["timestamp"] and called["model_name"] == "policy-7b"
    assert tool_use["final_metrics"] == {"total_prompt_tokens": 80, "total_completion_tokens": 13, "total_steps": 4}
    kept = tool_use["extra"]["trajproxy"]
    assert (kept["reward"], kept["rewards"], kept["status"]) == (1.0, {"reward": 1.0, "style": 0.5}, "finished")
    assert [step["source"] for step in colour["steps"]] == ["user", "agent"]
    assert colour["steps"][1]["message"] == "Blue."


def test_the_validator_refuses_what_breaks_the_rfc(recorded: dict[str, Any], tmp_path: Path) -> None:
    [line, _] = lines_of(recorded["url"], tmp_path, "--shape", "atif")
    out_of_order = json.loads(json.dumps(line))
    out_of_order["steps"][0]["step_id"] = 7
    misplaced = json.loads(json.dumps(line))
    misplaced["steps"][1]["metrics"] = {"prompt_tokens": 1}  # metrics on a user step
    unpaired = json.loads(json.dumps(line))
    unpaired["steps"][2]["observation"]["results"][0]["source_call_id"] = "call_nobody_made"
    for broken in (out_of_order, misplaced, unpaired):
        with pytest.raises(pydantic.ValidationError):
            atif.Trajectory.model_validate(broken)


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
