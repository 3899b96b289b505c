"""Domain values: episodes, turns, replies and rewards, as frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

JsonObject = dict[str, Any]


class EpisodeStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def closed(self) -> bool:
        return self in _CLOSED_EPISODE


_CLOSED_EPISODE = {EpisodeStatus.FINISHED, EpisodeStatus.FAILED, EpisodeStatus.CANCELLED}


class TurnStatus(StrEnum):
    PARKED = "parked"
    LEASED = "leased"
    ANSWERED = "answered"
    ABANDONED = "abandoned"
    EXPIRED = "expired"
    FAILED = "failed"

    @property
    def open(self) -> bool:
        return self in (TurnStatus.PARKED, TurnStatus.LEASED)


@dataclass(frozen=True, slots=True)
class Episode:
    id: str
    key_hash: str
    task: str
    metadata: JsonObject
    status: EpisodeStatus
    created_at: float
    turn_timeout_s: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class AgentError:
    """An error the trainer chose to hand the agent instead of a message."""

    status: int
    message: str
    kind: str = "server_error"


@dataclass(frozen=True, slots=True)
class Reply:
    """The action: an assistant message in chat shape (or an error for the agent), plus training extras."""

    message: JsonObject | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    error: AgentError | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    completion_token_ids: tuple[int, ...] | None = None
    logprobs: tuple[float, ...] | None = None
    policy_version: str | None = None
    answered_by: str = "trainer"


@dataclass(frozen=True, slots=True)
class Turn:
    """One LLM call an agent made: the request as received and normalised, and what became of it."""

    id: str
    episode_id: str
    seq: int
    dialect: str
    request: JsonObject
    wire: bytes
    stream: bool
    status: TurnStatus
    created_at: float
    model: str | None = None
    deliveries: int = 0
    lease_id: str | None = None
    leased_at: float | None = None
    answered_at: float | None = None
    ended_at: float | None = None
    reply: Reply | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Reward:
    id: str
    episode_id: str
    name: str
    value: float
    source: str
    created_at: float
    turn_id: str | None = None
    info: JsonObject = field(default_factory=dict)
