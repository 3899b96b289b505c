"""The trainer API's calls as data (method, path, body, how to read the answer), and its errors: what the sync
and async clients send."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx
from pydantic import BaseModel

from proxy import schema
from proxy.trainer_token import find_token

M = TypeVar("M", bound=BaseModel)
_LONG_POLL_MARGIN_S = 30.0


class TrajproxyAPIError(Exception):
    """The trainer API refused a request; `status` and `kind` say why, `message` says what to do."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(f"{status} {kind}: {message}")
        self.status = status
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class ApiCall(Generic[M]):
    """One API call, described once and sent by either client."""

    method: str
    path: str
    parse: Callable[[Any], M]
    json: dict[str, Any] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None


def reply_body(
    content: str | None,
    tool_calls: Sequence[dict[str, Any]] | None,
    message: dict[str, Any] | None,
    error: dict[str, Any] | None,
    extras: dict[str, Any],
) -> dict[str, Any]:
    body = {k: v for k, v in extras.items() if v is not None}
    if error is not None:
        body["error"] = error
    else:
        body["message"] = dict(message or {})
        if content is not None:
            body["message"]["content"] = content
        if tool_calls is not None:
            body["message"]["tool_calls"] = list(tool_calls)
    return body


def long_poll(
    method: str,
    path: str,
    parse: Callable[[Any], M],
    wait_s: float,
    lease_s: float | None,
    json: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
) -> ApiCall[M]:
    """A call the server holds up to `wait_s`; the client waits that long and a margin more."""
    query = {**(params or {}), "wait": wait_s} | ({"lease": lease_s} if lease_s is not None else {})
    return ApiCall(method, path, parse, json=json, params=query, timeout_s=wait_s + _LONG_POLL_MARGIN_S)


class ApiCalls:
    """The trainer API's calls, as data; the clients below only send them."""

    @staticmethod
    def create_episode(
        task: str, metadata: dict[str, Any] | None, turn_timeout_s: float | None, settings: dict[str, Any]
    ) -> ApiCall[schema.EpisodeCreated]:
        body: dict[str, Any] = {"task": task, "metadata": metadata or {}, **settings}
        if turn_timeout_s is not None:
            body["turn_timeout_s"] = turn_timeout_s
        return ApiCall("POST", "/api/episodes", schema.EpisodeCreated.model_validate, json=body)

    @staticmethod
    def fork(episode_id: str, at_turn: int, n: int, options: dict[str, Any]) -> ApiCall[schema.Forks]:
        body = {"at_turn": at_turn, "n": n, **options}
        return ApiCall("POST", f"/api/episodes/{episode_id}/fork", schema.Forks.model_validate, json=body)

    @staticmethod
    def timestep(
        episode_id: str, action: str, body: dict[str, Any], wait_s: float, lease_s: float | None
    ) -> ApiCall[schema.TimeStep]:
        """`reset` or `step`: a long poll for the episode's next TimeStep."""
        path = f"/api/episodes/{episode_id}/{action}"
        return long_poll("POST", path, schema.TimeStep.model_validate, wait_s, lease_s, json=body)

    @staticmethod
    def next_turns(
        episode: str | None, max_turns: int, wait_s: float, lease_s: float | None
    ) -> ApiCall[schema.TurnBatch]:
        params = {"max": max_turns} | ({"episode": episode} if episode is not None else {})
        return long_poll("GET", "/api/turns/next", schema.TurnBatch.model_validate, wait_s, lease_s, params=params)

    @staticmethod
    def reply(turn_id: str, body: dict[str, Any]) -> ApiCall[schema.Turn]:
        return ApiCall("POST", f"/api/turns/{turn_id}/reply", schema.Turn.model_validate, json=body)

    @staticmethod
    def pause(mode: str, retry_after_s: float, drain_s: float) -> ApiCall[schema.PauseState]:
        body = {"mode": mode, "retry_after_s": retry_after_s, "drain_s": drain_s}
        timeout_s = drain_s + 30.0 if drain_s else None
        return ApiCall("POST", "/api/pause", schema.PauseState.model_validate, json=body, timeout_s=timeout_s)

    @staticmethod
    def resume(policy_version: str | None) -> ApiCall[schema.PauseState]:
        return ApiCall("POST", "/api/resume", schema.PauseState.model_validate, json={"policy_version": policy_version})

    @staticmethod
    def reply_many(replies: Sequence[dict[str, Any]]) -> ApiCall[schema.ReplyResults]:
        return ApiCall(
            "POST", "/api/turns/replies", schema.ReplyResults.model_validate, json={"replies": list(replies)}
        )

    @staticmethod
    def reply_and_pull(
        replies: Sequence[dict[str, Any]], episode: str | None, max_turns: int, wait_s: float, lease_s: float | None
    ) -> ApiCall[schema.ReplyResults]:
        params = {"pull": max_turns} | ({"episode": episode} if episode is not None else {})
        body = {"replies": list(replies)}
        return long_poll(
            "POST", "/api/turns/replies", schema.ReplyResults.model_validate, wait_s, lease_s, body, params
        )

    @staticmethod
    def forward(
        turn_id: str, model: str, options: dict[str, Any] | None, lease_id: str | None, on_failure: str = "return"
    ) -> ApiCall[schema.Turn]:
        body = {"model": model, "options": options or {}, "lease_id": lease_id, "on_failure": on_failure}
        return ApiCall("POST", f"/api/turns/{turn_id}/forward", schema.Turn.model_validate, json=body, timeout_s=600)

    @staticmethod
    def finish(episode_id: str, status: str, reason: str | None) -> ApiCall[schema.Episode]:
        body = {"status": status, "reason": reason}
        return ApiCall("POST", f"/api/episodes/{episode_id}/finish", schema.Episode.model_validate, json=body)

    @staticmethod
    def add_reward(
        episode_id: str, name: str, value: float, turn_id: str | None, source: str, info: dict[str, Any] | None
    ) -> ApiCall[schema.Reward]:
        body = {"name": name, "value": value, "turn_id": turn_id, "source": source, "info": info or {}}
        return ApiCall("POST", f"/api/episodes/{episode_id}/rewards", schema.Reward.model_validate, json=body)

    @staticmethod
    def episode(episode_id: str) -> ApiCall[schema.Episode]:
        return ApiCall("GET", f"/api/episodes/{episode_id}", schema.Episode.model_validate)

    @staticmethod
    def episodes(status: str | None, limit: int, offset: int) -> ApiCall[schema.EpisodeList]:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if status is not None:
            params["status"] = status
        return ApiCall("GET", "/api/episodes", schema.EpisodeList.model_validate, params=params)

    @staticmethod
    def turn(turn_id: str) -> ApiCall[schema.Turn]:
        return ApiCall("GET", f"/api/turns/{turn_id}", schema.Turn.model_validate)

    @staticmethod
    def trajectory(episode_id: str) -> ApiCall[schema.Trajectory]:
        return ApiCall("GET", f"/api/episodes/{episode_id}/trajectory", schema.Trajectory.model_validate)


def headers(token: str | None) -> dict[str, str]:
    """The trainer token header: `token`, else TRAJPROXY_TRAINER_TOKEN, else the token file `trajproxy serve`
    keeps (~/.config/trajproxy/trainer-token), else none."""
    token = token or find_token()
    return {"authorization": f"Bearer {token}"} if token else {}


def parse(call: ApiCall[M], response: httpx.Response) -> M:
    if response.is_success:
        return call.parse(response.json())
    try:
        error = response.json()["error"]
        kind, message = str(error["type"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        kind, message = "error", response.text
    raise TrajproxyAPIError(response.status_code, kind, message)
