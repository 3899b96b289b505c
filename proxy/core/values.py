"""Domain values: episodes, turns, replies and rewards, as frozen dataclasses; their ids, and episode keys (random
secrets for agents, stored only as hashes and compared in constant time)."""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import random
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from proxy.core.chunks import Body
from proxy.core.ids import TokenIds

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
class Answerer:
    """A model that answers some of an episode's calls in the trainer's place: any name litellm knows (`kind`
    "model"), or the policy being trained, served by an inference server that returns the token ids it sampled
    (`kind` "vllm" or "sglang", its `options` holding the server's `api_base` and the sampling parameters).

    As an episode's policy it answers every call. As a routing rule (an entry of the episode's `routes`) it answers
    the calls that match it: those for a model name matching `when_model` (a glob, e.g. `claude-3-5-haiku*`), or
    whose system prompt contains `when_system`. Calls answered by a rule are side calls, recorded as not trainable.
    """

    model: str
    options: JsonObject = field(default_factory=dict)
    when_model: str | None = None
    when_system: str | None = None
    kind: str = "model"

    @property
    def spec(self) -> str:
        """How the API names it: `model:NAME`, `vllm:NAME`, `sglang:NAME`."""
        return f"{self.kind}:{self.model}"

    @property
    def served(self) -> bool:
        """The policy being trained, on an inference server: its turns wait out a pause like a trainer's."""
        return self.kind in SERVED_KINDS

    def matches(self, request: JsonObject) -> bool:
        if self.when_model is not None:
            asked = request.get("model")
            if isinstance(asked, str) and fnmatch.fnmatchcase(asked, self.when_model):
                return True
        return self.when_system is not None and self.when_system in system_prompt(request)


SERVED_KINDS = ("vllm", "sglang")
POLICY_KINDS = ("model", *SERVED_KINDS)


def answerer_of(spec: str, options: JsonObject, served_only: bool = False) -> Answerer | None:
    """The model a policy spec names (`model:NAME`, `vllm:NAME`, `sglang:NAME`, or with `served_only` the last
    two alone); None for `trainer` or another spec."""
    kind, sep, model = spec.partition(":")
    known = SERVED_KINDS if served_only else POLICY_KINDS
    return Answerer(model, options, kind=kind) if sep and kind in known else None


def system_prompt(request: JsonObject) -> str:
    """The text of a chat request's system (and developer) messages."""
    texts = []
    for message in request.get("messages") or ():
        if isinstance(message, dict) and message.get("role") in ("system", "developer"):
            texts.append(text_of(message.get("content")))
    return "\n".join(texts)


def text_of(content: Any) -> str:
    """The text of a message's content, a string or a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


@dataclass(frozen=True, slots=True)
class Budget:
    """Limits on an episode; past any of them the agent's next call is refused (or the episode finished)."""

    max_turns: int | None = None
    max_tokens: int | None = None  # prompt + completion tokens over all the episode's answered turns
    deadline_at: float | None = None  # unix time
    finish: bool = False  # over budget: finish the episode instead of refusing calls with 429
    max_staleness: int | None = None  # how many policy versions its turns may span (asynchronous training)
    stale_fails: bool = False  # past max_staleness: fail the episode (an infrastructure failure), not finish it

    def exceeded(self, turns: int, tokens: int, now: float) -> str | None:
        """Why a new call is over this budget, or None if it is within it."""
        if self.max_turns is not None and turns >= self.max_turns:
            return f"over budget: the episode has used its {self.max_turns} turns"
        if self.max_tokens is not None and tokens >= self.max_tokens:
            return f"over budget: the episode has used {tokens} of its {self.max_tokens} tokens"
        if self.deadline_at is not None and now >= self.deadline_at:
            deadline = datetime.fromtimestamp(self.deadline_at, UTC).isoformat(timespec="seconds")
            return f"over budget: the episode's deadline passed at {deadline}"
        return None

    def stale(self, held: Sequence[str], versions: Sequence[str]) -> str | None:
        """Why a new call would take the episode past its `max_staleness`: the newest of `versions` (all the policy
        versions named so far, oldest first) more than that many versions after the oldest it `held`."""
        if self.max_staleness is None or not versions:
            return None
        places = {version: place for place, version in enumerate(versions)}
        known = [places[version] for version in held if version in places]
        if not known or len(versions) - 1 - min(known) <= self.max_staleness:
            return None
        oldest = versions[min(known)]
        return f"stale: policy version {versions[-1]} is more than {self.max_staleness} after its oldest, {oldest}"


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
    policy: Answerer | None = None  # None: the trainer answers
    routes: tuple[Answerer, ...] = ()  # routing rules: each answers the side calls it matches
    budget: Budget = field(default_factory=Budget)
    over_budget: str | None = None  # why the episode's last refused call was over budget


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
    prompt_token_ids: tuple[int, ...] | TokenIds | None = None  # TokenIds: a served policy's (proxy/core/ids.py)
    completion_token_ids: tuple[int, ...] | None = None
    logprobs: tuple[float, ...] | None = None
    policy_version: str | None = None
    answered_by: str = "trainer"
    cost_usd: float | None = None  # what the model's call cost, for turns a model answered
    # Where a served policy answered: what its server was asked (the sampling parameters) and answered, verbatim,
    # so the turn can be re-scored.
    served: JsonObject | None = None
    # Recorded by trajproxy for a reply with prompt ids whose turn extends an earlier one with ids: whether the
    # prompt ids start with that turn's prompt + completion ids, and if not, the first index where they differ.
    extends_parent: bool | None = None
    drift_at: int | None = None


@dataclass(frozen=True, slots=True)
class Turn:
    """One LLM call an agent made: the request as received and normalised, and what became of it."""

    id: str
    episode_id: str
    seq: int
    dialect: str
    request: JsonObject
    wire: Body  # its body as sent: bytes, or the chunks it arrived in (a continued call's, never joined)
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
    trainable: bool = True  # False for side calls a routing rule sent to a fixed model
    branch: int = 0  # calls that extend one conversation share a branch; compaction or a sub-agent opens another
    parent_id: str | None = None  # the turn whose conversation this one extends
    extends: Extension | None = field(default=None, compare=False, repr=False)  # how its body extends an earlier's


@dataclass(frozen=True, slots=True)
class Extension:
    """A call whose body is an earlier call's of its episode with messages added (`proxy.http.prefix`): the first
    `shared_bytes` of its body are that turn's, its first `messages` messages are that turn's (all of them, as
    parsed: the same values), and nothing else in it differs. What was worked out for the earlier call (its
    messages' prints, its body's pieces) then holds for that part of this one."""

    turn_id: str
    messages: int
    shared_bytes: int
    own_bytes: int  # of its body's bytes in memory, those not that turn's body's (read against it, it holds those)


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


MAIN_REWARD = "reward"  # the name of an episode's main reward: its return; other names are its components


def episode_return(named: Mapping[str, float]) -> float | None:
    """An episode's return, from its episode-level rewards by name (a name given twice counts its sum): the one
    named `reward`; with none so named, the sum of them all, so one reward is the return whatever its name; None
    with none."""
    if not named:
        return None
    return named[MAIN_REWARD] if MAIN_REWARD in named else sum(named.values())


def episode_rewards(rewards: Iterable[Reward]) -> dict[str, float]:
    """The episode-level rewards (not a turn's) by name, each name's values summed, in the order first recorded."""
    named: dict[str, float] = {}
    for reward in rewards:
        if reward.turn_id is None:
            named[reward.name] = named.get(reward.name, 0.0) + reward.value
    return named


@dataclass(frozen=True, slots=True)
class Tally:
    """What an open episode has used so far: its next turn number, tokens and branch number."""

    next_seq: int = 0
    tokens: int = 0
    next_branch: int = 0


KEY_PREFIX = "tpk-"


def new_key() -> str:
    """A fresh episode key with 256 bits of randomness."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def same_secret(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def new_id(prefix: str) -> str:
    """A unique id that sorts roughly by creation time (millisecond clock, then 48 random bits). Ids are not
    secrets, so they come from the fast generator (seeded from the OS), not from a system call each."""
    return f"{prefix}_{time.time_ns() // 1_000_000:011x}{random.getrandbits(48):012x}"
