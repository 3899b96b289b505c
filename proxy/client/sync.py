"""TrainerClient: the trainer API from blocking code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

import httpx

from proxy import schema
from proxy.client.calls import ApiCall, ApiCalls, M, headers, parse, reply_body
from proxy.client.stream import TurnStream, stream_url


class TrainerClient:
    """Blocking client for the trainer API. With no `token`, it sends the one in TRAJPROXY_TRAINER_TOKEN or in
    the file `trajproxy serve` keeps it in."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        self._http = httpx.Client(base_url=base_url, headers=headers(token), timeout=timeout_s)
        self._headers = headers(token)
        self._timeout_s = timeout_s

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: ApiCall[M]) -> M:
        timeout = call.timeout_s if call.timeout_s is not None else self._http.timeout
        response = self._http.request(call.method, call.path, json=call.json, params=call.params, timeout=timeout)
        return parse(call, response)

    def create_episode(
        self,
        task: str = "",
        metadata: dict[str, Any] | None = None,
        turn_timeout_s: float | None = None,
        **settings: Any,
    ) -> schema.EpisodeCreated:
        """A new episode; `settings` are the optional fields of POST /api/episodes (policy, policy_options,
        routes, max_turns, max_tokens, deadline_s, on_budget)."""
        return self._send(ApiCalls.create_episode(task, metadata, turn_timeout_s, settings))

    def fork(self, episode_id: str, at_turn: int, n: int = 1, **options: Any) -> list[schema.EpisodeCreated]:
        """n episodes forked from `episode_id` at call `at_turn`: each replays the parent's first `at_turn` calls,
        then its policy answers. `options` are the optional fields of POST /api/episodes/{id}/fork (policy,
        policy_options, ignore, min_similarity, on_divergence)."""
        return self._send(ApiCalls.fork(episode_id, at_turn, n, options)).episodes

    def reset(self, episode_id: str, wait_s: float = 60.0, lease_s: float | None = None) -> schema.TimeStep:
        """dm_env's reset: the FIRST TimeStep, the agent's first call (waits up to `wait_s` for it)."""
        return self._send(ApiCalls.timestep(episode_id, "reset", {}, wait_s, lease_s))

    def step(
        self,
        episode_id: str,
        content: str | None = None,
        *,
        tool_calls: Sequence[dict[str, Any]] | None = None,
        message: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        wait_s: float = 60.0,
        lease_s: float | None = None,
        **extras: Any,
    ) -> schema.TimeStep:
        """dm_env's step: answer the current call, then the next TimeStep (MID, or LAST with the reward)."""
        body = reply_body(content, tool_calls, message, error, extras)
        return self._send(ApiCalls.timestep(episode_id, "step", body, wait_s, lease_s))

    def next_turns(
        self, episode: str | None = None, max: int = 1, wait_s: float = 0.0, lease_s: float | None = None
    ) -> list[schema.Turn]:
        return self._send(ApiCalls.next_turns(episode, max, wait_s, lease_s)).turns

    def reply(
        self,
        turn_id: str,
        content: str | None = None,
        *,
        tool_calls: Sequence[dict[str, Any]] | None = None,
        message: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        **extras: Any,
    ) -> schema.Turn:
        """Answer a turn; `extras` are the optional reply fields (finish_reason, usage, logprobs, lease_id…)."""
        return self._send(ApiCalls.reply(turn_id, reply_body(content, tool_calls, message, error, extras)))

    def pause(self, mode: str = "hold", retry_after_s: float = 5.0, drain_s: float = 0.0) -> schema.PauseState:
        """Pause new agent calls for a weight update (hold them, or reject them with 429); see `resume`. With
        `drain_s`, it returns once no turn is in flight (or after that long: `in_flight` says how many are)."""
        return self._send(ApiCalls.pause(mode, retry_after_s, drain_s))

    def resume(self, policy_version: str | None = None) -> schema.PauseState:
        """Release the held calls; replies recorded from now on carry `policy_version` (the new weights' name)."""
        return self._send(ApiCalls.resume(policy_version))

    def stream(self, episode: str | None = None, max: int = 64, lease_s: float | None = None) -> TurnStream:
        """The trainer's stream (a WebSocket): turns pushed as they park, up to `max` awaiting a reply at once,
        and replies acknowledged after their commit. Leases, redelivery and idempotence as with `next_turns`.
        Use it as `with client.stream() as stream:`."""
        url = stream_url(str(self._http.base_url), episode, max, lease_s)
        return TurnStream(url, self._headers, self._timeout_s)

    def reply_many(self, replies: Sequence[dict[str, Any]]) -> list[schema.ReplyResult]:
        """Answer many turns in one call: each item is a reply body with its `turn_id`; results in order."""
        return self._send(ApiCalls.reply_many(replies)).results

    def reply_and_pull(
        self,
        replies: Sequence[dict[str, Any]],
        *,
        episode: str | None = None,
        max: int = 64,
        wait_s: float = 30.0,
        lease_s: float | None = None,
    ) -> schema.ReplyResults:
        """Answer many turns and lease the next batch in the same exchange (one round trip a batch): `results`
        for the replies, in order, and `turns`, up to `max` leased (waiting up to `wait_s` for the first)."""
        return self._send(ApiCalls.reply_and_pull(replies, episode, max, wait_s, lease_s))

    def forward(
        self,
        turn_id: str,
        model: str,
        options: dict[str, Any] | None = None,
        lease_id: str | None = None,
        on_failure: str = "return",
    ) -> schema.Turn:
        """Answer a turn from `model` through litellm (e.g. "openai/gpt-4o-mini", options={"api_base": ...}), or from
        the served policy (vllm:NAME). If the model fails: TrajproxyAPIError 502, the turn yours again (`return`), or
        the failure is the turn's answer, handed to its agent as the model's (`agent`: the turn's reply has `error`)."""
        return self._send(ApiCalls.forward(turn_id, model, options, lease_id, on_failure))

    def finish(self, episode_id: str, status: str = "finished", reason: str | None = None) -> schema.Episode:
        return self._send(ApiCalls.finish(episode_id, status, reason))

    def add_reward(
        self,
        episode_id: str,
        value: float,
        name: str = "reward",
        *,
        turn_id: str | None = None,
        source: str = "trainer",
        info: dict[str, Any] | None = None,
    ) -> schema.Reward:
        return self._send(ApiCalls.add_reward(episode_id, name, value, turn_id, source, info))

    def episode(self, episode_id: str) -> schema.Episode:
        return self._send(ApiCalls.episode(episode_id))

    def episodes(self, status: str | None = None, limit: int = 100, offset: int = 0) -> schema.EpisodeList:
        return self._send(ApiCalls.episodes(status, limit, offset))

    def turn(self, turn_id: str) -> schema.Turn:
        return self._send(ApiCalls.turn(turn_id))

    def trajectory(self, episode_id: str) -> schema.Trajectory:
        return self._send(ApiCalls.trajectory(episode_id))
