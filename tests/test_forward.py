"""Forwarding a turn to a model through litellm, against a fake OpenAI-compatible upstream."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

from proxy.client import TrainerClient, TrajproxyAPIError
from tests.conftest import FakeModel


def ask(episode: Any, text: str) -> list[Any]:
    """A streamed call by the episode's agent: its chunks, read to the end on a client closed after it."""
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        return list(
            client.chat.completions.create(
                model="agent-asked-for-this",
                messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": text}],
                tools=[{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}],
                stream=True,
            )
        )


def test_a_forwarded_turn_is_answered_by_the_model_and_recorded_as_such(
    server: Any, trainer: TrainerClient, background: Any, fake_model: FakeModel
) -> None:
    episode = trainer.create_episode()
    call = background(lambda: "".join(c.choices[0].delta.content or "" for c in ask(episode, "hi") if c.choices))
    turn = trainer.next_turns(wait_s=5)[0]
    answered = trainer.forward(turn.id, "openai/fake-teacher", fake_model.options(), lease_id=turn.lease_id)

    assert call.result(timeout=30) == "upstream saw 2 messages"
    assert answered.reply is not None and answered.reply.answered_by == "model:openai/fake-teacher"
    assert answered.reply.usage is not None
    assert (answered.reply.usage.prompt_tokens, answered.reply.usage.completion_tokens) == (5, 2)
    sent = fake_model.seen[0]
    assert sent["model"] == "fake-teacher"
    assert sent["messages"][-1] == {"role": "user", "content": "hi"}
    assert sent["tools"][0]["function"]["name"] == "bash"  # tool definitions reach the model
    recorded = trainer.trajectory(episode.id).turns[0]
    assert recorded.status == "answered"
    assert recorded.reply is not None and recorded.reply.answered_by == "model:openai/fake-teacher"


def test_forwarding_a_parked_turn_keeps_pollers_off_it(
    server: Any, trainer: TrainerClient, background: Any, fake_model: FakeModel
) -> None:
    episode = trainer.create_episode()
    call = background(ask, episode, "hello")
    deadline = time.monotonic() + 5
    while not (pending := [t for t in trainer.trajectory(episode.id).turns if t.status == "parked"]):
        assert time.monotonic() < deadline, "the agent's call was never parked"
        time.sleep(0.02)
    answered = trainer.forward(pending[0].id, "openai/fake-teacher", fake_model.options())
    assert answered.deliveries == 1  # leased to the forward itself, and to no poller
    assert call.result(timeout=30)
    assert trainer.next_turns(wait_s=0) == []


def test_a_failing_model_leaves_the_turn_for_the_trainer(
    server: Any, trainer: TrainerClient, background: Any, fake_model: FakeModel
) -> None:
    episode = trainer.create_episode()
    call = background(
        lambda: "".join(c.choices[0].delta.content or "" for c in ask(episode, "please fail") if c.choices)
    )
    turn = trainer.next_turns(wait_s=5)[0]
    with pytest.raises(TrajproxyAPIError) as failed:
        trainer.forward(turn.id, "openai/fake-teacher", fake_model.options(), lease_id=turn.lease_id)
    assert failed.value.status == 502
    assert "fake-teacher" in failed.value.message
    assert trainer.turn(turn.id).status == "leased"

    trainer.reply(turn.id, "the trainer steps in", lease_id=turn.lease_id)
    assert call.result(timeout=10) == "the trainer steps in"


def test_forwarding_an_answered_turn_is_refused(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    call = background(ask, episode, "hello")
    turn = trainer.next_turns(wait_s=5)[0]
    trainer.reply(turn.id, "done")
    call.result(timeout=5)
    with pytest.raises(TrajproxyAPIError) as refused:
        trainer.forward(turn.id, "openai/anything")
    assert refused.value.status == 409
