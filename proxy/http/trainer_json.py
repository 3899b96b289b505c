"""Domain values as trainer-API JSON: episodes, rewards, trajectories and dm_env's time steps (a turn's own view and
a trainer's reply as the domain's are `proxy.http.turns`', which every turn crosses)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict

import orjson

from proxy import schema
from proxy.core.broker import TurnPages
from proxy.core.steps import TimeStep
from proxy.core.values import Answerer, Budget, Episode, JsonObject, Reward, answerer_of
from proxy.http.turns import turn_view


def episode_view(episode: Episode) -> JsonObject:
    budget = episode.budget
    return {
        "id": episode.id,
        "status": episode.status.value,
        "task": episode.task,
        "metadata": episode.metadata,
        "turn_timeout_s": episode.turn_timeout_s,
        "created_at": episode.created_at,
        "started_at": episode.started_at,
        "ended_at": episode.ended_at,
        "reason": episode.reason,
        "policy": episode.policy.spec if episode.policy else "trainer",
        "policy_options": episode.policy.options if episode.policy else {},
        "routes": [_rule_view(rule) for rule in episode.routes],
        "budget": {
            "max_turns": budget.max_turns,
            "max_tokens": budget.max_tokens,
            "deadline_at": budget.deadline_at,
            "on_budget": "finish" if budget.finish else "reject",
            "max_staleness": budget.max_staleness,
            "on_stale": "fail" if budget.stale_fails else "finish",
        },
        "over_budget": episode.over_budget,
    }


def _rule_view(rule: Answerer) -> JsonObject:
    """A routing rule as the API's `routes` list holds it."""
    return {
        "model": rule.model,
        "when_model": rule.when_model,
        "when_system": rule.when_system,
        "options": rule.options,
    }


def reward_view(reward: Reward) -> JsonObject:
    return asdict(reward)


PAGE_BYTES = 1 << 20  # about how much of a trajectory is held at once while it is sent


async def trajectory_json(episode: Episode, rewards: list[Reward], pages: TurnPages) -> AsyncIterator[bytes]:
    """A trajectory as JSON, made a page of turns at a time: each page as many turns as fit PAGE_BYTES by the
    pages before it, so that memory stays about that whatever the episode's size."""
    by_turn: dict[str, list[JsonObject]] = {}
    for reward in rewards:
        if reward.turn_id is not None:
            by_turn.setdefault(reward.turn_id, []).append(reward_view(reward))
    yield b'{"episode":' + orjson.dumps(episode_view(episode)) + b',"turns":['
    versions: dict[str, None] = {}
    seq, limit, separator = -1, 1, b""
    while page := await pages(seq, limit):
        chunk = b",".join(orjson.dumps({**turn_view(turn), "rewards": by_turn.get(turn.id, [])}) for turn in page)
        versions |= dict.fromkeys(t.reply.policy_version for t in page if t.reply and t.reply.policy_version)
        yield separator + chunk
        seq, separator = page[-1].seq, b","
        limit = max(1, min(256, PAGE_BYTES * len(page) // max(1, len(chunk))))
    rest = [reward_view(reward) for reward in rewards if reward.turn_id is None]
    yield b'],"rewards":' + orjson.dumps(rest) + b',"policy_versions":' + orjson.dumps(list(versions)) + b"}"


def episode_settings(body: schema.EpisodeCreate) -> JsonObject:
    """The broker's keyword arguments for a new episode's policy, routes and budget."""
    return {
        "policy": answerer_of(body.policy, body.policy_options),
        "routes": [Answerer(r.model, r.options, r.when_model, r.when_system) for r in body.routes],
        "budget": Budget(
            body.max_turns,
            body.max_tokens,
            None,
            body.on_budget == "finish",
            body.max_staleness,
            body.on_stale == "fail",
        ),
        "deadline_s": body.deadline_s,
    }


def timestep_view(step: TimeStep) -> JsonObject:
    turn = step.observation
    return {
        "step_type": int(step.step_type),
        "observation": turn.request if turn else None,
        "reward": step.reward,
        "discount": step.discount,
        "turn_id": turn.id if turn else None,
        "turn": turn_view(turn) if turn else None,
        "episode": episode_view(step.episode),
        "rewards": [reward_view(reward) for reward in step.rewards],
    }
