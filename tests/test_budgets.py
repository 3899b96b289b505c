"""Episode budgets (max turns, max tokens, deadline): refused with 429 and a clear message, or the episode
finished, and the reason visible to the trainer in the episode record."""

from __future__ import annotations

import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

from proxy.client import TrainerClient
from tests.test_trainer_api import HELLO, MODEL, agent_for, ask, ask_as, snapshot


def answer_next(trainer: TrainerClient, episode_id: str, **extras: Any) -> None:
    [turn] = trainer.next_turns(episode=episode_id, wait_s=5)
    trainer.reply(turn.id, "ok", **extras)


def over_budget(episode: Any, status: int) -> httpx.Response:
    """The agent's next call (its conversation so far and one more message: the same body again, with no retry header,
    is the last call retried, which a restarted process answers with its recorded reply), expected to be refused with
    `status`."""
    following = [*HELLO, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
    response = httpx.post(
        episode.env["OPENAI_BASE_URL"] + "/chat/completions",
        headers={"authorization": f"Bearer {episode.key}"},
        json={"model": MODEL, "messages": following},
        timeout=10,
    )
    assert response.status_code == status, response.text
    return response


def test_past_max_turns_the_agent_gets_429_and_the_trainer_sees_why(
    server: Any, trainer: TrainerClient, background: Any
) -> None:
    episode = trainer.create_episode(max_turns=2)
    for _ in range(2):
        call = background(ask_as, episode)
        answer_next(trainer, episode.id)
        assert call.result(timeout=10).choices[0].message.content == "ok"
    before = snapshot(server, episode.id)

    refused = over_budget(episode, 429)
    error = refused.json()["error"]
    assert error["type"] == "budget_exceeded"
    assert "over budget: the episode has used its 2 turns" in error["message"]
    assert refused.headers["x-should-retry"] == "false"  # retrying cannot help: SDKs must not

    with agent_for(episode, max_retries=2) as retrying, pytest.raises(openai.RateLimitError):  # the SDK sees it too
        ask(retrying)
    recorded = trainer.episode(episode.id)
    assert recorded.status == "running"
    assert recorded.over_budget is not None and "its 2 turns" in recorded.over_budget
    assert snapshot(server, episode.id)["turns"] == before["turns"]  # no turn for a refused call


def test_max_tokens_counts_the_usage_of_answered_turns(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode(max_tokens=150)
    call = background(ask_as, episode)
    answer_next(trainer, episode.id, usage={"prompt_tokens": 60, "completion_tokens": 40})
    call.result(timeout=10)
    call = background(ask_as, episode)  # 100 of 150 used: still within budget
    answer_next(trainer, episode.id, usage={"prompt_tokens": 70, "completion_tokens": 30})
    call.result(timeout=10)

    message = over_budget(episode, 429).json()["error"]["message"]
    assert "used 200 of its 150 tokens" in message


def test_a_deadline_refuses_calls_after_it(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode(deadline_s=0.3)
    time.sleep(0.4)
    assert "deadline passed" in over_budget(episode, 429).json()["error"]["message"]


def test_over_budget_can_finish_the_episode_instead(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode(max_turns=1, on_budget="finish")
    call = background(ask_as, episode)
    answer_next(trainer, episode.id)
    call.result(timeout=10)

    error = over_budget(episode, 410).json()["error"]
    assert "over budget" in error["message"] and error["type"] == "episode_closed"
    recorded = trainer.episode(episode.id)
    assert recorded.status == "finished" and recorded.ended_at is not None
    assert recorded.reason == recorded.over_budget == "over budget: the episode has used its 1 turns"
    over_budget(episode, 410)  # and stays finished


def test_anthropic_agents_get_their_own_429(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode(max_turns=1, deadline_s=0.1)
    time.sleep(0.2)
    claude = anthropic.Anthropic(base_url=episode.env["ANTHROPIC_BASE_URL"], api_key=episode.key, max_retries=0)
    with claude, pytest.raises(anthropic.RateLimitError) as refused:
        claude.messages.create(model="claude-sonnet-4", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert "deadline passed" in str(refused.value)


def test_the_token_tally_survives_a_restart(make_server: Any, background: Any) -> None:
    first = make_server()
    with TrainerClient(first.url, first.token) as trainer:
        episode = trainer.create_episode(max_tokens=50)
        call = background(ask_as, episode)
        answer_next(trainer, episode.id, usage={"prompt_tokens": 30, "completion_tokens": 25})
        call.result(timeout=10)
    first.stop()
    second = make_server()  # a fresh process on the same database has never seen this episode
    moved = episode.model_copy(update={"env": {"OPENAI_BASE_URL": f"{second.url}/v1"}})
    assert "used 55 of its 50 tokens" in over_budget(moved, 429).json()["error"]["message"]
