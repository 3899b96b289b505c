"""The dm_env view over REST: POST /api/episodes/{id}/reset and /step, driven against a live agent loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionFunctionToolParam

from proxy.client import TrainerClient, TrajproxyAPIError
from tests.test_trainer_api import agent_for, api, error_of, snapshot

BASH: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {"name": "bash", "parameters": {"type": "object"}},
}
RUN_LS = {"tool_calls": [{"id": "c1", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]}


def toy_agent(episode: Any, task: str = "list the files") -> int:
    """A tool-using agent of the episode: runs every tool call it is given (pretending) until the model stops
    asking."""
    messages: list[Any] = [{"role": "system", "content": "you are an agent"}, {"role": "user", "content": task}]
    calls = 0
    with agent_for(episode) as agent:
        while True:
            calls += 1
            choice = agent.chat.completions.create(model="policy", messages=messages, tools=[BASH]).choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            if not choice.message.tool_calls:
                return calls
            for call in choice.message.tool_calls:
                assert call.type == "function"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"ran {call.function.name}"})


def run_episode(trainer: TrainerClient, episode: Any, background: Callable[..., Future[Any]]) -> Future[int]:
    """The agent plays the episode; when it ends, a grader rewards it and finishes the episode."""

    def play() -> int:
        calls = toy_agent(episode)
        trainer.add_reward(episode.id, 0.75, source="grader")
        trainer.finish(episode.id)
        return calls

    return background(play)


def test_reset_and_step_walk_an_episode_from_first_call_to_reward(
    server: Any, trainer: TrainerClient, background: Any
) -> None:
    episode = trainer.create_episode(task="list the files")
    agent = run_episode(trainer, episode, background)

    first = trainer.reset(episode.id, wait_s=10)
    assert first.first() and (first.step_type, first.reward, first.discount) == (0, None, None)
    assert first.observation is not None
    assert first.observation["messages"][-1] == {"role": "user", "content": "list the files"}
    assert first.observation["tools"] == [BASH]
    assert first.turn is not None and first.turn.id == first.turn_id and first.turn.lease_id  # typed, lease and all
    assert first.turn.request == first.observation

    mid = trainer.step(episode.id, message=RUN_LS, wait_s=10)
    assert mid.mid() and (mid.reward, mid.discount) == (0.0, 1.0)
    assert mid.observation is not None and mid.turn_id != first.turn_id
    assert mid.observation["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "ran bash"}

    last = trainer.step(episode.id, "all done", wait_s=10)
    assert last.last() and last.observation is None and last.turn_id is None
    assert (last.reward, last.discount) == (0.75, 0.0)
    assert [(r.name, r.value, r.source) for r in last.rewards] == [("reward", 0.75, "grader")]
    assert last.episode.status == "finished"
    assert agent.result(timeout=10) == 2

    turns = trainer.trajectory(episode.id).turns
    assert [t.reply.message["content"] if t.reply and t.reply.message else None for t in turns] == [None, "all done"]
    assert [t.status for t in turns] == ["answered", "answered"]


def test_a_step_sent_twice_answers_once_and_goes_on(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()

    def slow_agent() -> None:  # thinks for a while between its calls, so the trainer's step has to wait
        with agent_for(episode) as agent:
            messages: list[Any] = [{"role": "user", "content": "go"}]
            reply = agent.chat.completions.create(model="policy", messages=messages).choices[0].message
            time.sleep(1.5)
            messages += [reply.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": "c1", "content": "a b"}]
            agent.chat.completions.create(model="policy", messages=messages)

    background(slow_agent)
    first = trainer.reset(episode.id, wait_s=10)
    body = {"message": RUN_LS}
    with httpx.Client(base_url=server.url, timeout=30, headers={"authorization": f"Bearer {server.token}"}) as http:
        # the trainer hangs up while the step waits; the action it sent stands, and sending it again goes on
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"/api/episodes/{episode.id}/step?wait=20", json=body, timeout=0.5)
        again = http.post(f"/api/episodes/{episode.id}/step?wait=10", json=body)
    assert again.status_code == 200, again.text
    assert again.json()["step_type"] == 1
    turns = trainer.trajectory(episode.id).turns
    assert [t.id for t in turns] == [first.turn_id, again.json()["turn_id"]]
    assert turns[0].reply is not None and turns[0].reply.message is not None
    assert turns[0].reply.message["tool_calls"][0]["function"]["arguments"] == '{"cmd": "ls"}'

    # a different action for the call already answered is refused, and nothing recorded changes
    before = snapshot(server, episode.id)
    changed = api(server, "POST", f"/api/episodes/{episode.id}/step?wait=0", json={"turn_id": first.turn_id,
                  "message": {"content": "something else"}})  # fmt: skip
    assert "different reply" in error_of(changed, 409)["message"]
    assert snapshot(server, episode.id) == before
    trainer.finish(episode.id, "cancelled")  # lets the agent go


def test_steps_out_of_order_are_refused_with_what_to_do(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    early = api(server, "POST", f"/api/episodes/{episode.id}/step", json={"message": {"content": "hi"}})
    assert "reset it first" in error_of(early, 409)["message"]

    waited = api(server, "POST", f"/api/episodes/{episode.id}/reset?wait=0.2", json={})
    assert "made no call within 0.2 s" in error_of(waited, 408, "no_turn_yet")["message"]

    run_episode(trainer, episode, background)
    trainer.reset(episode.id, wait_s=10)
    again = api(server, "POST", f"/api/episodes/{episode.id}/reset", json={})
    assert "go on with step" in error_of(again, 409)["message"]

    for action in ("reset", "step"):
        missing = api(server, "POST", f"/api/episodes/ep_missing/{action}?wait=0", json={"message": {"content": "x"}})
        error_of(missing, 404)
    malformed = api(server, "POST", f"/api/episodes/{episode.id}/step", json={"message": {"content": 3}})
    assert malformed.status_code == 422
    both = api(server, "POST", f"/api/episodes/{episode.id}/step", json={"message": {}, "error": {"status": 500,
               "message": "x"}})  # fmt: skip
    assert both.status_code == 422
    trainer.finish(episode.id, "cancelled")  # lets the agent go


def test_an_agent_that_ends_without_calling_gives_last_at_reset(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    trainer.add_reward(episode.id, -1.0, name="crashed", source="grader")
    trainer.finish(episode.id, "failed", "the agent crashed on start-up")
    step = trainer.reset(episode.id, wait_s=5)
    assert step.last() and step.reward == -1.0 and step.episode.reason == "the agent crashed on start-up"


def test_a_budget_cut_is_a_truncation(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode(max_turns=1, on_budget="finish")
    agent = background(toy_agent, episode)
    trainer.reset(episode.id, wait_s=10)
    last = trainer.step(episode.id, message=RUN_LS, wait_s=10)  # the agent's second call is over budget
    assert last.last() and last.discount == 1.0 and last.reward == 0.0
    assert last.episode.over_budget is not None and "1 turns" in last.episode.over_budget
    with pytest.raises(openai.APIStatusError) as refused:
        agent.result(timeout=10)
    assert refused.value.status_code == 410


@pytest.mark.parametrize("episodes", [6])
def test_many_episodes_step_side_by_side(server: Any, trainer: TrainerClient, background: Any, episodes: int) -> None:
    made = [trainer.create_episode(task=f"task {n}") for n in range(episodes)]
    agents = [run_episode(trainer, episode, background) for episode in made]

    def walk(episode: Any) -> list[int]:
        with TrainerClient(server.url, server.token) as own:
            kinds: list[int] = [own.reset(episode.id, wait_s=10).step_type]
            kinds.append(own.step(episode.id, message=RUN_LS, wait_s=10).step_type)
            kinds.append(own.step(episode.id, f"done with {episode.id}", wait_s=10).step_type)
            return kinds

    walks = [background(walk, episode) for episode in made]
    assert [w.result(timeout=30) for w in walks] == [[0, 1, 2]] * episodes
    assert [a.result(timeout=10) for a in agents] == [2] * episodes
    for episode in made:
        final = trainer.trajectory(episode.id).turns[-1]
        assert final.reply is not None and final.reply.message == {"role": "assistant",
                                                                    "content": f"done with {episode.id}"}  # fmt: skip


def test_the_client_raises_api_errors_for_steps(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    with pytest.raises(TrajproxyAPIError) as refused:
        trainer.step(episode.id, "hi")
    assert refused.value.status == 409
