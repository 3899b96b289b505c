"""Domain values as trainer-API JSON, and trainer replies as domain values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import orjson

from proxy import schema
from proxy.core.steps import TimeStep
from proxy.core.values import AgentError, Answerer, Budget, Episode, JsonObject, Reply, Reward, Turn, Usage, answerer_of
from proxy.schema import replies


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


def turn_view(turn: Turn) -> JsonObject:
    return {
        "id": turn.id,
        "episode_id": turn.episode_id,
        "seq": turn.seq,
        "dialect": turn.dialect,
        "status": turn.status.value,
        "model": turn.model,
        "stream": turn.stream,
        "request": turn.request,
        "wire": None if turn.dialect == "chat" else orjson.Fragment(turn.wire),  # chat: the same as request
        "lease_id": turn.lease_id,
        "deliveries": turn.deliveries,
        "created_at": turn.created_at,
        "leased_at": turn.leased_at,
        "answered_at": turn.answered_at,
        "ended_at": turn.ended_at,
        "reason": turn.reason,
        "reply": _reply_view(turn.reply) if turn.reply else None,
        "trainable": turn.trainable,
        "branch": turn.branch,
        "parent_id": turn.parent_id,
    }


def reward_view(reward: Reward) -> JsonObject:
    return asdict(reward)


def trajectory_view(episode: Episode, turns: list[Turn], rewards: list[Reward]) -> JsonObject:
    by_turn: dict[str, list[JsonObject]] = {}
    for reward in rewards:
        if reward.turn_id is not None:
            by_turn.setdefault(reward.turn_id, []).append(reward_view(reward))
    return {
        "episode": episode_view(episode),
        "turns": [{**turn_view(turn), "rewards": by_turn.get(turn.id, [])} for turn in turns],
        "rewards": [reward_view(reward) for reward in rewards if reward.turn_id is None],
        "policy_versions": list(
            dict.fromkeys(turn.reply.policy_version for turn in turns if turn.reply and turn.reply.policy_version)
        ),
    }


def reply_from(body: schema.ReplyIn | replies.ReplyItem, turn_id: str) -> Reply:
    """The domain reply for a trainer's (from the pydantic model or the hot path's Struct, alike); tool-call ids
    are derived from the turn, so a resent reply matches."""
    message = None
    given: Sequence[schema.ToolCall | replies.ToolCall] = ()
    finish_reason = body.finish_reason
    if isinstance(body, replies.ReplyItem):
        message = body.message_for_agent()
        given = body.message.tool_calls or () if body.message is not None else ()
    elif body.message is not None:
        message, given = body.message.model_dump(exclude_none=True), body.message.tool_calls or []
    if message is not None:
        message.setdefault("content", None)
        calls = [_tool_call(call, turn_id, index) for index, call in enumerate(given)]
        if calls:
            message["tool_calls"] = calls
        elif message["content"] is None:
            message["content"] = ""
        finish_reason = finish_reason or ("tool_calls" if calls else "stop")
    usage = body.usage
    error = body.error
    return Reply(
        message=message,
        finish_reason=finish_reason,
        usage=Usage(usage.prompt_tokens, usage.completion_tokens) if usage else None,
        error=AgentError(error.status, error.message, error.type) if error else None,
        prompt_token_ids=tuple(body.prompt_token_ids) if body.prompt_token_ids is not None else None,
        completion_token_ids=tuple(body.completion_token_ids) if body.completion_token_ids is not None else None,
        logprobs=tuple(body.logprobs) if body.logprobs is not None else None,
        policy_version=body.policy_version,
    )


def _tool_call(call: schema.ToolCall | replies.ToolCall, turn_id: str, index: int) -> JsonObject:
    arguments: Any = call.function.arguments
    if not isinstance(arguments, str):
        arguments = orjson.dumps(arguments).decode()
    made: JsonObject = {
        "id": call.id or f"call_{turn_id.rpartition('_')[2]}_{index}",
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }
    if call.extra_content is not None:
        made["extra_content"] = call.extra_content
    return made


def _reply_view(reply: Reply) -> JsonObject:
    usage = reply.usage
    error = reply.error
    return {
        "message": reply.message,
        "finish_reason": reply.finish_reason,
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        }
        if usage
        else None,
        "error": {"status": error.status, "message": error.message, "type": error.kind} if error else None,
        "prompt_token_ids": reply.prompt_token_ids,
        "completion_token_ids": reply.completion_token_ids,
        "logprobs": reply.logprobs,
        "policy_version": reply.policy_version,
        "answered_by": reply.answered_by,
        "cost_usd": reply.cost_usd,
        "extends_parent": reply.extends_parent,
        "drift_at": reply.drift_at,
        "served": reply.served,
    }


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
