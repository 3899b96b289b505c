"""The trainer API's request bodies and queries."""

from __future__ import annotations

import importlib.util
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.config import JsonDict

from proxy.families import BY_NAME
from proxy.schema.fields import (
    HttpStatus,
    Json,
    Limit,
    Metadata,
    ModelOptions,
    Name,
    Text,
    TokenCount,
    TokenId,
    _Open,
    _storable,
    _Strict,
    agent_extras,
)


def _given(of: str, **types: str) -> JsonDict:
    """What a model validator checks, said in the schema: `of` ("oneOf": exactly one, "anyOf": at least one) the
    fields is given as a value of its type, not left out or null."""
    return {of: [{"required": [name], "properties": {name: {"type": kind}}} for name, kind in types.items()]}


POLICY = r"^(trainer|(model|vllm|sglang):.+)$"
POLICY_MEANS = (
    "trainer; model:NAME (any litellm model); or vllm:NAME / sglang:NAME, the policy being trained on its inference "
    "server (policy_options.api_base), its exact token ids recorded"
)


def served_base_problem(base: object) -> str | None:
    """What is wrong with a served policy's `api_base`, in words for its option; None if nothing: it is its server's
    OpenAI-compatible base, http(s)://HOST:PORT/v1 (without /v1, every call meets the server's 404)."""
    if not isinstance(base, str) or not base.startswith(("http://", "https://")):
        return "needs its server's URL (http://HOST:PORT/v1)"
    if not urlsplit(base).path.rstrip("/").endswith("/v1"):
        return "must end in /v1, the server's OpenAI-compatible base (http://HOST:PORT/v1)"
    return None


def _check_served(policy: str | None, options: dict[str, object]) -> None:
    """A served policy names its server: refused at once, not at the agent's first call."""
    if policy is not None and policy.startswith(("vllm:", "sglang:")):
        if (problem := served_base_problem(options.get("api_base"))) is not None:
            raise ValueError(f"policy {policy}: policy_options.api_base {problem}")
        if options.get("mode", "tokens") not in ("tokens", "chat"):
            raise ValueError(
                f"policy_options.mode is 'tokens' (token in, token out) or 'chat', not {options['mode']!r}"
            )
        if options.get("on_discontinuity", "branch") not in ("branch", "fail", "rerender"):
            chosen = options["on_discontinuity"]
            raise ValueError(f"policy_options.on_discontinuity is 'branch', 'fail' or 'rerender', not {chosen!r}")
        if "family" in options and options["family"] not in BY_NAME:
            raise ValueError(f"policy_options.family is one of {', '.join(sorted(BY_NAME))}, not {options['family']!r}")
        if options.get("mode", "tokens") == "tokens" and not _installed("transformers"):
            raise ValueError(
                f"policy {policy} in tokens mode (token in, token out) renders prompts with the model's tokenizer, "
                "which needs transformers: pip install 'trajproxy[served]' where trajproxy runs "
                "(or policy_options.mode 'chat')"
            )


def _installed(module: str) -> bool:
    """Whether `module` can be imported here, found without importing it (transformers takes seconds to)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class RouteIn(_Strict):
    """Send the calls that match to `model` (a litellm name), answered without the trainer, not trainable."""

    model_config = ConfigDict(
        extra="forbid", strict=True, json_schema_extra=_given("anyOf", when_model="string", when_system="string")
    )

    model: Name = Field(min_length=1)
    when_model: Text | None = Field(default=None, min_length=1, description="a glob on the model the agent asks for")
    when_system: Text | None = Field(default=None, min_length=1, description="text in the call's system prompt")
    options: ModelOptions = Field(default_factory=dict)

    @model_validator(mode="after")
    def _has_condition(self) -> RouteIn:
        if self.when_model is None and self.when_system is None:
            raise ValueError("a route needs 'when_model' or 'when_system' to say which calls it takes")
        return self


class EpisodeCreate(_Strict):
    task: Name = ""
    metadata: Metadata = Field(default_factory=dict)
    turn_timeout_s: float | None = Field(default=None, gt=0, le=7 * 86400)
    policy: Name = Field(default="trainer", pattern=POLICY, description=POLICY_MEANS)
    policy_options: ModelOptions = Field(
        default_factory=dict, description="the model's options; a served policy's api_base and sampling parameters"
    )
    routes: list[RouteIn] = Field(default_factory=list, max_length=100)
    max_turns: Limit | None = None
    max_tokens: Limit | None = None
    deadline_s: float | None = Field(default=None, gt=0, le=30 * 86400, description="seconds from creation")
    on_budget: Literal["reject", "finish"] = "reject"
    max_staleness: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="asynchronous training: the episode ends at its next call once the newest policy version is more "
        "than this many versions after the oldest its turns hold",
    )
    on_stale: Literal["finish", "fail"] = Field(
        default="finish", description="past max_staleness: finish the episode, or fail it (an infrastructure failure)"
    )

    @model_validator(mode="after")
    def _served_has_server(self) -> EpisodeCreate:
        _check_served(self.policy, self.policy_options)
        return self


class ForkIn(_Strict):
    at_turn: int = Field(ge=0, le=100_000, description="replay the parent's first at_turn calls; the next is new")
    n: int = Field(default=1, ge=1, le=64, description="how many forks")
    policy: Name | None = Field(default=None, pattern=POLICY, description="after the replay (default: the parent's)")
    policy_options: ModelOptions = Field(default_factory=dict)
    ignore: list[Name] = Field(
        default_factory=list, max_length=100, description="field names left out when a call is matched, anywhere"
    )
    min_similarity: float = Field(default=1.0, ge=0, le=1, description="below 1: how alike a call must be")
    on_divergence: Literal["policy", "fail"] = Field(
        default="policy", description="a call that differs: hand it to the policy, or fail it"
    )


class FunctionCall(_Strict):
    name: Text = Field(min_length=1)
    arguments: Text | Json = "{}"


class ToolCall(_Strict):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    extra_content: Json | None = Field(
        default=None,
        description="provider fields for the agent, as Google's OpenAI-compatible API names them: "
        "a Gemini agent gets `google.thought_signature` on its functionCall part",
    )


class Message(_Open):
    """An assistant message in chat shape; extra fields are passed to the agent, those its dialect renders in the shape
    it reads: `reasoning_content` text, `thinking_blocks` (Anthropic) and `reasoning_items` (Responses) lists."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["assistant"] = "assistant"
    content: Text | None = None
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="after")
    def _storable_extras(self) -> Message:
        if self.model_extra:
            agent_extras(_storable(self.model_extra))
        return self


class UsageIn(_Strict):
    prompt_tokens: TokenCount
    completion_tokens: TokenCount


class AgentErrorIn(_Strict):
    status: HttpStatus
    message: Text
    type: Text = "server_error"


FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


class ReplyIn(_Strict):
    """The action: a message for the agent (or an error to give it), with optional training extras."""

    model_config = ConfigDict(
        extra="forbid", strict=True, json_schema_extra=_given("oneOf", message="object", error="object")
    )

    message: Message | None = None
    error: AgentErrorIn | None = None
    finish_reason: FinishReason | None = None
    usage: UsageIn | None = None
    prompt_token_ids: list[TokenId] | None = None
    completion_token_ids: list[TokenId] | None = None
    logprobs: list[Annotated[float, Field(allow_inf_nan=False)]] | None = None
    policy_version: Name | None = None
    lease_id: Text | None = None

    @model_validator(mode="after")
    def _message_or_error(self) -> ReplyIn:
        if (self.message is None) == (self.error is None):
            raise ValueError("a reply carries exactly one of 'message' or 'error'")
        return self


class ForwardIn(_Strict):
    """Answer a turn from a model through litellm, or from the served policy (`vllm:NAME`, `sglang:NAME`, with
    `options.api_base`); `options` go to the call (api_base, temperature, …)."""

    model: Name = Field(min_length=1, description="a litellm model name, or vllm:NAME / sglang:NAME")
    options: Json = Field(default_factory=dict)
    lease_id: Text | None = None
    on_failure: Literal["return", "agent"] = Field(
        default="return",
        description="when the model fails: return (502; the turn is yours again, under your lease) or agent (the "
        "failure is the turn's answer: its agent gets the error, recorded as answered by the model)",
    )

    @model_validator(mode="after")
    def _served_has_server(self) -> ForwardIn:
        _check_served(self.model, self.options)
        return self


class ReplyItem(ReplyIn):
    turn_id: Name = Field(min_length=1)


class TurnsQuery(BaseModel):
    """Which parked turns to lease: from one episode or any, how many, how long to wait for the first."""

    episode: Name | None = Field(default=None, description="only this episode's turns")
    max: int = Field(default=1, ge=1, le=4096, description="the most turns to lease at once")
    wait: float = Field(default=0, ge=0, le=600, description="seconds to wait for the first turn")
    lease: float | None = Field(default=None, gt=0, le=86400, description="seconds until unanswered turns return")


class RepliesQuery(BaseModel):
    """With `pull`, a batch reply also leases the next batch, as `GET /api/turns/next` would: one exchange a batch."""

    pull: int = Field(default=0, ge=0, le=4096, description="after the replies, lease up to this many turns")
    episode: Name | None = Field(default=None, description="with pull: only this episode's turns")
    wait: float = Field(default=0, ge=0, le=600, description="with pull: seconds to wait for the first turn")
    lease: float | None = Field(default=None, gt=0, le=86400, description="with pull: seconds the lease lasts")


class ReplyBatch(_Strict):
    """Replies to many turns in one call; each succeeds or fails on its own."""

    replies: list[ReplyItem] = Field(min_length=1, max_length=4096)


class StreamQuery(BaseModel):
    """The trainer's stream (WebSocket `GET /api/turns/stream`): which turns it is pushed, how many may wait for
    a reply at once, and their lease."""

    model_config = ConfigDict(extra="forbid")  # no route checks a WebSocket's query names for it

    episode: Name | None = Field(default=None, description="only this episode's turns")
    max: int = Field(default=64, ge=1, le=4096, description="the most turns pushed and not yet replied to")
    lease: float | None = Field(default=None, gt=0, le=86400, description="seconds until unanswered turns return")


class StreamReplies(ReplyBatch):
    """A message the trainer sends on its stream: a batch of replies, acknowledged with `id` after their commit."""

    id: Annotated[int, Field(ge=0, le=2**53)] | Name | None = Field(
        default=None, description="echoed in the acknowledgement"
    )


class PauseIn(_Strict):
    """hold: park new agent calls out of the queue until resume (and with drain_s wait for the turns in flight);
    keep: the same, but a served policy's calls already sent finish on the weights they were sent to, stamped with
    the version they were sent under, so nothing waits for them; reject: answer new calls 429 with Retry-After."""

    mode: Literal["hold", "keep", "reject"] = "hold"
    retry_after_s: float = Field(default=5.0, gt=0, le=3600)
    drain_s: float = Field(
        default=0.0, ge=0, le=3600, description="wait up to this long for the turns in flight to finish"
    )


class ResumeIn(_Strict):
    """Resume after a weight update: replies recorded from now on carry `policy_version` (unless a trainer's
    reply names its own)."""

    policy_version: Name | None = Field(default=None, min_length=1, max_length=200)


class PauseState(_Open):
    paused: Literal["hold", "keep", "reject"] | None
    released: int = 0
    in_flight: int = Field(default=0, description="open turns not held by the pause (on the replica answering)")
    policy_version: str | None = None


class StepIn(ReplyIn):
    """The action for the episode's current call (or for `turn_id`), as a reply."""

    turn_id: Name | None = None


class FinishIn(_Strict):
    status: Literal["finished", "failed", "cancelled"] = "finished"
    reason: Name | None = Field(default=None, max_length=2000)  # repeated in every later error for the episode


class RewardIn(_Strict):
    name: Name = Field(default="reward", min_length=1, max_length=200)
    value: float = Field(allow_inf_nan=False)
    turn_id: Name | None = None
    source: Name = Field(default="trainer", min_length=1, max_length=200)
    info: Json = Field(default_factory=dict)
