"""Who answers an episode's LLM calls during a run: an external trainer, a script, or a model.

A policy serves the turns of the episodes it is given until they finish. The trainer's and a model's do nothing
here: an external trainer pulls the turns over the trainer API, and a model answers in trajproxy itself, named
when each episode is created (a run policy's `episode`, the API's `policy` and `policy_options`), as the API does.
A script answers from the run, over the trainer API.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Protocol

import pydantic

from proxy import schema
from proxy.client import AsyncTrainerClient, TrajproxyAPIError
from proxy.core.values import POLICY_KINDS
from proxy.settings import key_values

_POLL_S = 1.0


class Policy(Protocol):
    async def serve(self, trainer: AsyncTrainerClient, episode_id: str) -> None:
        """Answer the episode's turns until it is cancelled."""
        ...


class TrainerPolicy:
    """An external trainer answers: nothing to do here."""

    @property
    def episode(self) -> dict[str, Any]:
        return {"policy": "trainer"}  # named, not left to the API's default: a fork's would be its parent's

    async def serve(self, trainer: AsyncTrainerClient, episode_id: str) -> None:
        await asyncio.Event().wait()


class ScriptedPolicy:
    """Replies from a JSONL file, one object per turn in order: {"content": ..., "tool_calls": ...}.

    The policy's turn n of every episode gets line n; past the end, the last line repeats. A fork goes on where
    its parent's script stood: after the lines its replayed calls used.
    """

    def __init__(self, path: str | Path) -> None:
        self.replies: list[dict[str, Any]] = []
        for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
            if line.strip():
                try:
                    reply = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from e
                if not isinstance(reply, dict) or not ({"content", "tool_calls"} & reply.keys()):
                    raise ValueError(f'{path}:{number}: expected {{"content": ...}} or {{"tool_calls": [...]}}')
                self.replies.append(reply)
        if not self.replies:
            raise ValueError(f"{path}: the script has no replies")

    @property
    def episode(self) -> dict[str, Any]:
        return {"policy": "trainer"}  # to trajproxy, the trainer's: the run answers over the trainer API

    async def serve(self, trainer: AsyncTrainerClient, episode_id: str) -> None:
        answered = await _replayed(trainer, episode_id)
        while True:
            for turn in await trainer.next_turns(episode=episode_id, max=8, wait_s=_POLL_S * 10):
                reply = self.replies[min(answered, len(self.replies) - 1)]
                answered += 1
                await _answer(trainer.reply(turn.id, message=reply, lease_id=turn.lease_id))


class ModelPolicy:
    """A model answers, in trajproxy itself: any name litellm knows (`model:openai/gpt-4o-mini`) or the policy being
    trained on its inference server (`vllm:NAME`, `sglang:NAME`, its token ids recorded). Each episode is created
    with it (`episode`: the API's `policy` and `policy_options`), so the broker sends every call to the model as it
    parks, with no round trip through the run: nothing to do here.

    A call the model fails goes back to its agent at once as a 502 with the provider's message, in the agent's own
    dialect; its turn is recorded failed with that message, an infrastructure failure of the episode's samples
    rather than a score."""

    def __init__(self, spec: str, options: dict[str, Any] | None = None) -> None:
        self.spec = spec
        self.options = options or {}
        _check(spec, self.options)

    @property
    def episode(self) -> dict[str, Any]:
        return {"policy": self.spec, "policy_options": self.options}

    async def serve(self, trainer: AsyncTrainerClient, episode_id: str) -> None:
        await asyncio.Event().wait()


def _check(spec: str, options: dict[str, Any]) -> None:
    """Refuse a policy the API would refuse, by the API's own rule (a served policy names its server, its
    `api_base`, ending in /v1): said now, in the command line's words, before any sandbox starts."""
    try:
        schema.EpisodeCreate(policy=spec, policy_options=options)
    except pydantic.ValidationError as e:
        said = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
        said = said.replace(f"policy {spec}:", f"--policy {spec}:").replace("policy_options.", "--policy-option ")
        raise ValueError(said if said.startswith(f"--policy {spec}") else f"--policy {spec}: {said}") from None


async def _replayed(trainer: AsyncTrainerClient, episode_id: str) -> int:
    """How many of the policy's turns a fork replays from its parent (0 for an episode that is not a fork): its
    parent's trainable calls before the fork's turn."""
    fork = (await trainer.episode(episode_id)).metadata.get("fork")
    if not isinstance(fork, dict):
        return 0
    parent = await trainer.trajectory(fork["parent"])
    return sum(turn.trainable and turn.seq < fork["at_turn"] for turn in parent.turns)


async def _answer(call: Any) -> None:
    try:
        await call
    except TrajproxyAPIError as e:
        if e.status != 409:  # 409: the turn ended meanwhile (its agent left, or the episode finished)
            raise


RunPolicy = TrainerPolicy | ScriptedPolicy | ModelPolicy


def policy_from(spec: str, options: dict[str, Any] | None = None) -> RunPolicy:
    """`trainer`, `scripted:FILE`, `model:NAME` or `vllm:NAME` / `sglang:NAME` (a served policy, whose token ids
    are recorded), with the model's `options`; ValueError says why not."""
    kind, _, argument = spec.partition(":")
    if options and kind not in POLICY_KINDS:
        raise ValueError(f"--policy-option is for model:, vllm: and sglang: policies, not {kind}")
    if kind == "trainer" and not argument:
        return TrainerPolicy()
    if kind == "scripted" and argument:
        return ScriptedPolicy(argument)
    if kind in POLICY_KINDS and argument:
        return ModelPolicy(spec, options)
    raise ValueError(f"unknown policy {spec!r}: use trainer, scripted:FILE, model:NAME, vllm:NAME or sglang:NAME")


def policy_options(items: list[str]) -> dict[str, Any]:
    """`--policy-option KEY=VALUE` pairs; a value that reads as JSON (a number, true, a list) is taken so."""
    return key_values(items, "--policy-option")
