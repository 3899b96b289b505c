"""The sample format (the export's `tokens` shape): one versioned line per branch of an episode, which trainers'
adapters (verl, SkyRL, slime, TRL) take as is. Its JSON Schema is `sample.schema.json`, beside this module.

A line is the branch as one token sequence: `prompt_ids`, then `completion_ids` holding the policy's tokens (loss
mask 1) and the tokens the environment added between calls (loss mask 0), with the rollout's `logprobs` aligned to
them and `turns` marking where each call's sampled ids lie. Loss falls only on ids the policy is proven to have
sampled in exactly that context: where a call's prompt drifts from the sequence so far (a chat template that drops
earlier reasoning, an agent that edits its history) inside what came after the first prompt, the sequence is cut
there and goes on with the call's prompt (loss mask 0), so an earlier output is masked from the cut on, and `drifts`
says where and how many sampled ids lost their loss; where it drifts inside the first prompt, a new line starts.

A call that token in, token out could not continue, rendered in full with `on_discontinuity: branch`, starts a
line of its own, so that the line before keeps the loss of every id it sampled. Each call's sampled ids are in
exactly one line, so no sampled token is trained twice. A line whose prompt begins with another line's sampled
tokens (a sub-agent restarting from its parent's history) holds them at no loss, and `shared_prefix` names the line
that trains them.

An episode whose infrastructure failed (cancelled; failed with no reward, as the runner records a lost sandbox or a
passed deadline; a call failed by a model or server that went down) is flagged `infrastructure_failure`, for
trainers to drop rather than score 0, as slime's ABORTED samples and SkyRL's masked timeouts are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from proxy.core.fork_plan import REPLAYED
from proxy.core.prefixes import first_difference
from proxy.core.values import JsonObject

SAMPLE_VERSION = 1
FIRST_CALL = "the first call of its branch"  # served.not_continued of a call with no parent to continue
SCHEMA_FILE = "sample.schema.json"
# How the core words a turn that failed only because its episode ended under it (the trainer finished the episode
# while the agent waited): the episode's own status tells that story, so such a turn is no failure of its own.
_CLOSED_UNDER_IT = re.compile(r"episode (closed$|\S+ is (finished|failed|cancelled)\b)")


def schema() -> JsonObject:
    """The sample format's JSON Schema (draft 2020-12), as packaged."""
    loaded: JsonObject = json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text())
    return loaded


def turn_failure(turn_id: str, reason: str | None) -> str | None:
    """Why a failed turn failed, as an infrastructure failure of its episode; None if it failed only because its
    episode closed."""
    if reason is not None and _CLOSED_UNDER_IT.match(reason):
        return None
    return reason or f"turn {turn_id} failed"


def infrastructure_failure(episode: Any, reward: float | None, failed_turn: str | None) -> str | None:
    """Why the episode's samples are no measure of its policy (None: they are). `failed_turn`: the reason of its
    first failed turn (`turn_failure`), if any."""
    if episode.status == "cancelled" or (episode.status == "failed" and reward is None):
        # trajproxy's runner records a lost sandbox or a passed deadline as failed with no reward, never reward 0
        said = "the episode was cancelled" if episode.status == "cancelled" else "the episode failed with no reward"
        return episode.reason or failed_turn or said
    return failed_turn


@dataclass(slots=True)
class _Sequence:
    prompt_ids: list[int]
    turns: list[JsonObject] = field(default_factory=list)  # each turn's span of sampled ids in completion_ids
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    drifts: list[JsonObject] = field(default_factory=list)

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def cut(self, at: int, turn_id: str) -> None:
        """A later prompt differs from the sequence from `at` on: keep what comes before, drop the rest (what was
        sampled there is not what that prompt holds, so it can have no loss)."""
        keep = at - len(self.prompt_ids)
        self.drifts.append({"turn_id": turn_id, "at": at, "masked": sum(self.loss_mask[keep:])})
        del self.completion_ids[keep:], self.loss_mask[keep:]
        if self.logprobs is not None:
            del self.logprobs[keep:]
        for span in self.turns:  # a turn's ids past the cut are no longer in the line
            span["start"], span["end"] = min(span["start"], keep), min(span["end"], keep)

    def add(self, turn: Any, between: list[int]) -> None:
        """The turn's reply after `between`, the tokens the environment added since the last; a reply a fork
        replayed from its parent is masked out like them."""
        reply = turn.reply
        completion = reply["completion_token_ids"]
        start = len(self.completion_ids) + len(between)
        self.turns.append(
            {
                "turn_id": turn.id,
                "start": start,
                "end": start + len(completion),
                "policy_version": turn.policy_version,
                "finish_reason": reply.get("finish_reason"),
            }
        )
        self.completion_ids += between + completion
        own = turn.answered_by != REPLAYED
        self.loss_mask += [0] * len(between) + [int(own)] * len(completion)
        logprobs = reply.get("logprobs")
        if self.logprobs is not None and logprobs is not None and len(logprobs) == len(completion):
            self.logprobs += [0.0] * len(between) + (logprobs if own else [0.0] * len(completion))
        else:
            self.logprobs = None  # some call came without logprobs for every token


def sample_lines(
    episode: Any,
    reward: float | None,
    common: JsonObject,
    answered: list[Any],
    failed_turn: str | None,
    bounded: Callable[[list[JsonObject]], list[JsonObject]] = lambda lines: lines,
) -> list[JsonObject]:
    """One episode's lines: a line per branch (more where a call drifted inside its branch's first prompt), in
    branch order. `common`: the fields every line of the episode carries; `failed_turn`: see
    `infrastructure_failure`; `bounded`: the lines kept, and masked, by staleness bounds (`staleness.bound`)."""
    sequences = _sequences(answered)
    failure = infrastructure_failure(episode, reward, failed_turn)
    lines = []
    for index, (branch, sequence) in enumerate(sequences):
        lines.append(
            {
                "sample_version": SAMPLE_VERSION,
                "prompt_ids": sequence.prompt_ids,
                "completion_ids": sequence.completion_ids,
                "loss_mask": sequence.loss_mask,
                "logprobs": sequence.logprobs,
                "branch": branch,
                "turns": sequence.turns,
                "turn_ids": [span["turn_id"] for span in sequence.turns],
                "policy_versions": [span["policy_version"] for span in sequence.turns],
                "stop_reason": sequence.turns[-1]["finish_reason"],
                "drifts": sequence.drifts,
                "shared_prefix": _shared_prefix(index, sequences),
                "stale_turns": 0,
                "infrastructure_failure": failure is not None,
                "failure_reason": failure,
                **common,
            }
        )
    lines = bounded(lines)
    trained = sum(1 for line in lines if any(line["loss_mask"]))
    for line in lines:
        line["reward_split"] = None if reward is None else reward / trained if any(line["loss_mask"]) else 0.0
    return lines


def _sequences(answered: list[Any]) -> list[tuple[int, _Sequence]]:
    """The token sequences of the turns answered with token ids, by branch (stable: a branch's lines in order)."""
    open_: dict[int, _Sequence] = {}
    finished: list[tuple[int, _Sequence]] = []
    for turn in answered:
        reply = turn.reply
        prompt, completion = reply.get("prompt_token_ids"), reply.get("completion_token_ids")
        if prompt is None or completion is None:
            continue
        sequence = open_.get(turn.branch)
        if sequence is not None and not branches_here(reply):
            at = first_difference(sequence.tokens(), prompt)
            if at is None or at >= len(sequence.prompt_ids):
                if at is not None:
                    sequence.cut(at, turn.id)
                sequence.add(turn, prompt[len(sequence.tokens()) :])
                continue
        if sequence is not None:
            finished.append((turn.branch, sequence))
        sequence = open_[turn.branch] = _Sequence(prompt)
        sequence.add(turn, [])
    finished += open_.items()
    return sorted(finished, key=lambda item: item[0])


def branches_here(reply: JsonObject) -> bool:
    """Whether token in, token out rendered this call in full at a discontinuity and asked for a line of its own
    (`on_discontinuity: branch`): its earlier turns train on their own line, never masked by this one."""
    served = reply.get("served")
    return isinstance(served, dict) and served.get("on_discontinuity") == "branch"


def not_continued(reply: JsonObject) -> bool:
    """Whether a tokens-mode turn did not continue its parent though it was not its branch's first call."""
    served = reply.get("served")
    return isinstance(served, dict) and served.get("not_continued") not in (None, FIRST_CALL)


def _shared_prefix(index: int, sequences: list[tuple[int, _Sequence]]) -> JsonObject | None:
    """The line whose sampled tokens this line's prompt begins with, there at no loss (that line trains them), and
    how many of its tokens the prompt begins with: the longest such overlap, the first line on a tie."""
    prompt = sequences[index][1].prompt_ids
    found: JsonObject | None = None
    for other, (branch, sequence) in enumerate(sequences):
        if other == index:
            continue
        overlap = _common_prefix(prompt, sequence.tokens())
        sampled = sequence.loss_mask[: max(0, overlap - len(sequence.prompt_ids))]
        if any(sampled) and (found is None or overlap > found["tokens"]):
            found = {"branch": branch, "turn_id": sequence.turns[0]["turn_id"], "tokens": overlap}
    return found


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` begin with alike."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case, compared at C speed
        return n
    return first_difference(a, b) or 0
