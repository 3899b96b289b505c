"""Model routing through litellm: an episode's policy, and routing rules for side calls, against a fake
upstream model. Checks who answered each turn, its usage and cost, and which turns are trainable."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from proxy.client import TrainerClient
from tests.conftest import FakeModel
from tests.test_trainer_api import agent_for, api, error_of

TEACHER = "openai/gpt-4o-mini"  # priced in litellm's bundled table
# gpt-4o-mini's list price: $0.15 per million prompt tokens, $0.60 per million completion tokens
FAKE_COST = 5 * 0.15e-6 + 2 * 0.60e-6


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-fake")  # credentials live in trajproxy's environment


def chat(episode: Any, text: str, model: str = "policy", system: str = "you are an agent") -> str | None:
    """One call by the episode's agent, on a client closed after it."""
    messages: Any = [{"role": "system", "content": system}, {"role": "user", "content": text}]
    with agent_for(episode) as agent:
        return agent.chat.completions.create(model=model, messages=messages).choices[0].message.content


def test_an_episode_whose_policy_is_a_model_never_reaches_the_trainer(
    server: Any, trainer: TrainerClient, fake_model: FakeModel
) -> None:
    episode = trainer.create_episode(policy=f"model:{TEACHER}", policy_options={"api_base": f"{fake_model.url}/v1"})
    assert episode.policy == f"model:{TEACHER}"

    assert chat(episode, "hi") == "upstream saw 2 messages"
    assert trainer.next_turns(wait_s=0.2) == []
    [turn] = trainer.trajectory(episode.id).turns
    assert turn.status == "answered" and turn.trainable
    assert turn.reply is not None and turn.reply.answered_by == f"model:{TEACHER}"
    assert turn.reply.usage is not None and turn.reply.usage.total_tokens == 7
    assert turn.reply.cost_usd == pytest.approx(FAKE_COST)
    assert fake_model.seen[-1]["messages"][-1] == {"role": "user", "content": "hi"}


def test_side_calls_go_to_a_fixed_model_and_are_not_trainable(
    server: Any, trainer: TrainerClient, background: Any, fake_model: FakeModel
) -> None:
    teacher = {"api_base": f"{fake_model.url}/v1"}
    episode = trainer.create_episode(
        routes=[
            {"model": TEACHER, "when_model": "claude-3-5-haiku*", "options": teacher},
            {"model": TEACHER, "when_system": "Generate a short title", "options": teacher},
        ]
    )
    assert chat(episode, "name this chat", model="claude-3-5-haiku-20241022") == "upstream saw 2 messages"
    assert chat(episode, "fix the bug", system="Generate a short title for: fix the bug") == "upstream saw 2 messages"
    trained = background(chat, episode, "fix the bug")
    [turn] = trainer.next_turns(wait_s=5)  # only the call the policy should answer reaches the trainer
    trainer.reply(turn.id, "on it")
    assert trained.result(timeout=10) == "on it"

    turns = trainer.trajectory(episode.id).turns
    assert [(t.trainable, t.reply and t.reply.answered_by) for t in turns] == [
        (False, f"model:{TEACHER}"),
        (False, f"model:{TEACHER}"),
        (True, "trainer"),
    ]
    assert [t.reply and t.reply.cost_usd for t in turns] == [pytest.approx(FAKE_COST)] * 2 + [None]


def test_a_routed_call_through_the_anthropic_dialect(
    server: Any, trainer: TrainerClient, fake_model: FakeModel
) -> None:
    episode = trainer.create_episode(
        routes=[{"model": TEACHER, "when_model": "claude-*-haiku*", "options": {"api_base": f"{fake_model.url}/v1"}}]
    )
    with anthropic.Anthropic(base_url=episode.env["ANTHROPIC_BASE_URL"], api_key=episode.key, max_retries=0) as claude:
        message = claude.messages.create(
            model="claude-3-5-haiku-latest", max_tokens=50, messages=[{"role": "user", "content": "a title please"}]
        )
        assert message.content[0].type == "text" and message.content[0].text == "upstream saw 1 messages"
        [turn] = trainer.trajectory(episode.id).turns
        assert turn.dialect == "anthropic" and not turn.trainable


def test_a_failing_model_fails_the_turn_and_tells_the_agent(
    server: Any, trainer: TrainerClient, fake_model: FakeModel
) -> None:
    episode = trainer.create_episode(policy=f"model:{TEACHER}", policy_options={"api_base": f"{fake_model.url}/v1"})
    with pytest.raises(openai.APIStatusError) as failed:
        chat(episode, "please fail")
    assert failed.value.status_code == 502
    assert "the model is down" in failed.value.message
    [turn] = trainer.trajectory(episode.id).turns
    assert turn.status == "failed" and turn.reason is not None and "the model is down" in turn.reason


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"policy": "banana"}, "trainer"),
        ({"policy": "model:x", "policy_options": {"api_key": "sk-live"}}, "OPENAI_API_KEY"),
        ({"routes": [{"model": "x", "when_model": "y", "options": {"Authorization_Token": "t"}}]}, "environment"),
        ({"routes": [{"model": "x"}]}, "when_model"),
        ({"routes": [{"model": "", "when_model": "y"}]}, "at least 1 character"),
        ({"max_turns": 0}, "greater than or equal to 1"),
        ({"deadline_s": -5}, "greater than 0"),
        ({"on_budget": "explode"}, "reject"),
    ],
)
def test_bad_episode_settings_are_refused_with_what_to_fix(
    server: Any, trainer: TrainerClient, body: dict[str, Any], says: str
) -> None:
    before = trainer.episodes().episodes
    refused = api(server, "POST", "/api/episodes", json=body)
    assert refused.status_code == 422
    assert says in refused.text
    assert trainer.episodes().episodes == before


def test_episode_settings_are_recorded_and_listed(server: Any, trainer: TrainerClient) -> None:
    route = {"model": TEACHER, "when_model": None, "when_system": "MARK", "options": {"temperature": 0}}
    episode = trainer.create_episode(routes=[route], max_turns=3, max_tokens=1000, deadline_s=60, on_budget="finish")
    for seen in (trainer.episode(episode.id), trainer.episodes().episodes[0]):
        assert seen.routes[0].model_dump() == route
        assert (seen.budget.max_turns, seen.budget.max_tokens, seen.budget.on_budget) == (3, 1000, "finish")
        assert seen.budget.deadline_at == pytest.approx(episode.created_at + 60)
        assert seen.policy == "trainer" and seen.over_budget is None


def test_an_unknown_model_has_no_cost_but_is_answered(
    server: Any, trainer: TrainerClient, fake_model: FakeModel
) -> None:
    options = {"api_base": f"{fake_model.url}/v1"}
    episode = trainer.create_episode(policy="model:openai/a-model-no-price-list-knows", policy_options=options)
    assert chat(episode, "hi") == "upstream saw 2 messages"
    [turn] = trainer.trajectory(episode.id).turns
    assert turn.reply is not None and turn.reply.cost_usd is None and turn.reply.usage is not None
    error_of(api(server, "GET", "/api/turns/tu_missing"), 404)
