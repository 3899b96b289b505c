"""Domain values as trainer-API JSON, and trainer replies as domain values."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import orjson

from proxy import wire
from proxy.core.values import AgentError, Episode, JsonObject, Reply, Reward, Turn, Usage


def episode_view(episode: Episode) -> JsonObject:
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
    }


def reply_from(body: wire.ReplyIn, turn_id: str) -> Reply:
    """The domain reply for a trainer's; tool-call ids are derived from the turn, so a resent reply matches."""
    message = None
    finish_reason = body.finish_reason
    if body.message is not None:
        message = body.message.model_dump(exclude_none=True)
        message.setdefault("content", None)
        calls = [_tool_call(call, turn_id, index) for index, call in enumerate(body.message.tool_calls or ())]
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


def _tool_call(call: wire.ToolCall, turn_id: str, index: int) -> JsonObject:
    arguments: Any = call.function.arguments
    if not isinstance(arguments, str):
        arguments = orjson.dumps(arguments).decode()
    return {
        "id": call.id or f"call_{turn_id.rpartition('_')[2]}_{index}",
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


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
    }
