"""Who answers an episode's LLM calls during a run: an external trainer, a script, or a model.

A policy serves the turns of the episodes it is given until they finish. The trainer policy does
nothing: an external trainer pulls the turns over the trainer API.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from proxy.client import AsyncTrainerClient, TrajproxyAPIError
from proxy.core.values import SERVED_KINDS
from proxy.schema.requests import served_base_problem
from proxy.settings import key_values

_POLL_S = 1.0


class Policy(Protocol):
    async def serve(self, trainer: AsyncTrainerClient, episode_id: str) -> None:
        """Answer the episode's turns until it is cancelled."""
        ...


class TrainerPolicy:
    """An external trainer answers: nothing to do here."""

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

    async def serve(self, trainer: AsyncTrainerClient, episode_id: str) -> None:
        answered = await _replayed(trainer, episode_id)
        while True:
            for turn in await trainer.next_turns(episode=episode_id, max=8, wait_s=_POLL_S * 10):
                reply = self.replies[min(answered, len(self.replies) - 1)]
                answered += 1
                await _answer(trainer.reply(turn.id, message=reply, lease_id=turn.lease_id))


OnFailure = Callable[[str, str], None]  # (episode id, what the model's provider said)


class ModelPolicy:
    """Forwards every turn to a model through litellm (any name litellm knows, e.g. openai/gpt-4o-mini).

    A call the model fails goes back to its agent at once as a 502 with the provider's message, in the agent's
    own dialect, rather than staying parked until the turn times out: recorded as the model's answer (its
    `answered_by`), not the trainer's. `on_failure` hears it too."""

    def __init__(self, model: str, options: dict[str, Any] | None = None, on_failure: OnFailure | None = None) -> None:
        self.model = model
        self.options = options or {}
        self._on_failure = on_failure or (lambda _episode_id, _message: None)

    async def serve(self, trainer: AsyncTrainerClient, episode_id: str) -> None:
        while True:
            for turn in await trainer.next_turns(episode=episode_id, max=8, wait_s=_POLL_S * 10):
                await _answer(self._forward(trainer, turn.id, turn.lease_id, episode_id))

    async def _forward(self, trainer: AsyncTrainerClient, turn_id: str, lease_id: str | None, episode_id: str) -> None:
        # a failure is the model's answer, recorded as the model's (answered_by), never as the trainer's
        turn = await trainer.forward(turn_id, self.model, self.options, lease_id=lease_id, on_failure="agent")
        if turn.reply is not None and turn.reply.error is not None:
            self._on_failure(episode_id, turn.reply.error.message)


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


def policy_from(spec: str, options: dict[str, Any] | None = None, on_failure: OnFailure | None = None) -> Policy:
    """`trainer`, `scripted:FILE`, `model:NAME` or `vllm:NAME` / `sglang:NAME` (a served policy, whose token ids
    are recorded), with the model's `options`; `on_failure` hears of the calls a model failed."""
    kind, _, argument = spec.partition(":")
    if options and kind not in ("model", *SERVED_KINDS):
        raise ValueError(f"--policy-option is for model:, vllm: and sglang: policies, not {kind}")
    if kind == "trainer" and not argument:
        return TrainerPolicy()
    if kind == "scripted" and argument:
        return ScriptedPolicy(argument)
    if kind == "model" and argument:
        return ModelPolicy(argument, options, on_failure=on_failure)
    if kind in SERVED_KINDS and argument:
        base = (options or {}).get("api_base")
        if base is None:
            raise ValueError(f"--policy {spec} needs --policy-option api_base=URL, its server (http://HOST:PORT/v1)")
        if (problem := served_base_problem(base)) is not None:
            raise ValueError(f"--policy {spec}: --policy-option api_base {problem}")
        return ModelPolicy(spec, options, on_failure=on_failure)
    raise ValueError(f"unknown policy {spec!r}: use trainer, scripted:FILE, model:NAME, vllm:NAME or sglang:NAME")


def policy_options(items: list[str]) -> dict[str, Any]:
    """`--policy-option KEY=VALUE` pairs; a value that reads as JSON (a number, true, a list) is taken so."""
    return key_values(items, "--policy-option")
