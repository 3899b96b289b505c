"""The trainer API's responses."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from proxy.schema.fields import _Open
from proxy.schema.requests import AgentErrorIn


class ErrorDetail(_Open):
    message: str
    type: str = Field(description="a stable, machine-readable kind: invalid_request_error, not_found_error, …")
    param: str | None = None
    code: str | None = None


class ApiError(_Open):
    """Every refusal and failure, in OpenAI's error shape."""

    error: ErrorDetail


class Route(_Open):
    model: str
    when_model: str | None
    when_system: str | None
    options: dict[str, Any]


class Budget(_Open):
    max_turns: int | None
    max_tokens: int | None
    deadline_at: float | None
    on_budget: Literal["reject", "finish"]
    max_staleness: int | None = None
    on_stale: Literal["finish", "fail"] = "finish"


class Episode(_Open):
    id: str
    status: Literal["pending", "running", "finished", "failed", "cancelled"]
    task: str
    metadata: dict[str, Any]
    turn_timeout_s: float | None
    created_at: float
    started_at: float | None
    ended_at: float | None
    reason: str | None
    policy: str
    policy_options: dict[str, Any]
    routes: list[Route]
    budget: Budget
    over_budget: str | None


class EpisodeCreated(Episode):
    key: str
    env: dict[str, str]


class Forks(_Open):
    episodes: list[EpisodeCreated]


class EpisodeList(_Open):
    episodes: list[Episode]
    next_offset: int | None


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ReplyOut(_Open):
    message: dict[str, Any] | None
    finish_reason: str | None
    usage: Usage | None
    error: AgentErrorIn | None
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    logprobs: list[float] | None
    policy_version: str | None
    answered_by: str
    cost_usd: float | None
    extends_parent: bool | None = Field(
        default=None, description="whether the prompt ids start with the parent turn's prompt + completion ids"
    )
    drift_at: int | None = Field(default=None, description="where not, the first index that differs")
    served: dict[str, Any] | None = Field(
        default=None, description="a served policy's sampling parameters and its server's answer, verbatim"
    )


class Reward(_Open):
    id: str
    episode_id: str
    turn_id: str | None
    name: str
    value: float
    source: str
    info: dict[str, Any]
    created_at: float


class Turn(_Open):
    id: str
    episode_id: str
    seq: int
    dialect: str
    status: Literal["parked", "leased", "answered", "abandoned", "expired", "failed"]
    model: str | None
    stream: bool
    request: dict[str, Any]
    wire: dict[str, Any] | None = None  # the body as the agent sent it, for dialects other than chat
    lease_id: str | None
    deliveries: int
    created_at: float
    leased_at: float | None
    answered_at: float | None
    ended_at: float | None
    reason: str | None
    reply: ReplyOut | None
    trainable: bool
    branch: int
    parent_id: str | None


class TurnBatch(_Open):
    turns: list[Turn]


class ReplyError(_Open):
    type: str
    message: str


class ReplyResult(_Open):
    turn_id: str
    status: int
    turn: Turn | None = None
    error: ReplyError | None = None


class ReplyResults(_Open):
    results: list[ReplyResult]
    turns: list[Turn] = Field(default_factory=list, description="with ?pull=N: the next batch, leased")


class TrajectoryTurn(Turn):
    rewards: list[Reward]


class Trajectory(_Open):
    episode: Episode
    turns: list[TrajectoryTurn]
    rewards: list[Reward]
    policy_versions: list[str] = Field(
        default_factory=list, description="every policy version the episode's answered turns carry, in turn order"
    )


class TimeStep(_Open):
    """dm_env's TimeStep: step_type 0 FIRST, 1 MID, 2 LAST. `observation` is the call to answer (None on LAST)."""

    step_type: Literal[0, 1, 2]
    observation: dict[str, Any] | None
    reward: float | None
    discount: float | None
    turn_id: str | None
    turn: Turn | None = None  # the whole turn `observation` is the request of: its lease (`lease_id`) and all
    episode: Episode
    rewards: list[Reward]

    def first(self) -> bool:
        return self.step_type == 0

    def mid(self) -> bool:
        return self.step_type == 1

    def last(self) -> bool:
        return self.step_type == 2
