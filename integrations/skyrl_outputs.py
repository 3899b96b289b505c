"""SkyRL's `GeneratorOutput` made from episodes' sample lines (`proxy/storage/sample.schema.json`): a plain mapping with
no SkyRL import, so that it is tested where SkyRL is not installed (integrations/skyrl.py's generator uses it).

How lines become rows:
- one line per trajectory (an agent that never rewrote its history): one row, its ids, mask and logprobs as recorded.
- several lines (a rewritten history, a compaction, a sub-agent): with SkyRL's step-wise training
  (`generator.step_wise_trajectories=true`) every line is a row of that trajectory, in order, `is_last_step` on the
  last; SkyRL broadcasts the trajectory's advantage to all of them, and a sampled id shared by two lines carries loss
  in one only. Without it SkyRL takes exactly one row per trajectory: the line with the most trainable ids is
  trained, the others are not (`rollout_metrics` counts them: `trajproxy/untrained_lines`, `.../untrained_ids`).
- an infrastructure failure (a lost sandbox, an engine that aborted, a passed deadline: the line's
  `infrastructure_failure`), an episode with no reward, or a rollout that raised: the trajectory is masked as SkyRL's
  Harbor generator masks a timeout, one placeholder row with loss mask [0] and reward 0.0, and by default so is every
  other trajectory of its prompt (a GRPO group scored against a missing member would be skewed).
- rewards are the episode's return (per trajectory; in step-wise rows, on the last row, 0.0 on the others), stop
  reasons SkyRL's vocabulary: `length` where the last call was cut by max_tokens, `stop` otherwise, `error` masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from integrations.rollouts import Rollout

PLACEHOLDER_ID = 0  # a masked trajectory's one token (as SkyRL's Harbor generator writes it)


@dataclass(frozen=True, slots=True)
class _Row:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float] | None
    reward: float
    stop_reason: str
    trajectory_id: Any
    last: bool
    seconds: float | None
    llm_seconds: float | None


def _masked(trajectory_id: Any, seconds: float | None, llm_seconds: float | None) -> _Row:
    one = [PLACEHOLDER_ID]
    return _Row(one, one, [0], [0.0], 0.0, "error", trajectory_id, True, seconds, llm_seconds)


def _failed(rollout: Rollout) -> str | None:
    """Why this trajectory cannot be scored (None when it can)."""
    if not rollout.samples:
        return rollout.reason or f"no sample lines ({rollout.status})"
    for line in rollout.samples:
        if line["infrastructure_failure"]:
            return str(line["failure_reason"])
    if rollout.samples[0]["reward"] is None:
        return "no reward"
    return None


def _stop_reason(line: dict[str, Any]) -> str:
    return "length" if line["stop_reason"] == "length" else "stop"


def _instance(trajectory_id: Any) -> Any:
    return getattr(trajectory_id, "instance_id", trajectory_id)


def generator_output(
    rollouts: Sequence[Rollout],
    trajectory_ids: Sequence[Any],
    *,
    step_wise: bool = False,
    mask_failed_groups: bool = True,
    overlong_filtering: bool = False,
    seconds: Sequence[float] | None = None,
    llm_seconds: Sequence[float] | None = None,
) -> dict[str, Any]:
    """SkyRL's `GeneratorOutput` (as a dict) for rollouts aligned with `trajectory_ids` (SkyRL's `TrajectoryID`s, or
    any values: a value's `instance_id` names its prompt group, else the value itself); the module's docstring says
    how lines become rows. `overlong_filtering`: SkyRL's `apply_overlong_filtering`, no loss on rows cut by length.
    `seconds`: each trajectory's wall time (SkyRL's `trajectory_generation_times`); `llm_seconds`: the part of it spent
    in the engine's calls (SkyRL's `trajectory_time_splits["llm"]`; the rest is the agent's, the sandbox's and the
    grader's). Every row of a trajectory carries its trajectory's times, as SkyRL's step-wise rows do."""
    assert len(rollouts) == len(trajectory_ids), "one rollout per trajectory"
    failures = [_failed(rollout) for rollout in rollouts]
    masked_groups = (
        {_instance(t) for t, why in zip(trajectory_ids, failures, strict=True) if why}
        if (mask_failed_groups)
        else set()
    )
    rows: list[_Row] = []
    untrained_lines = untrained_ids = 0
    for index, (rollout, trajectory_id) in enumerate(zip(rollouts, trajectory_ids, strict=True)):
        wall = seconds[index] if seconds is not None else None
        llm = llm_seconds[index] if llm_seconds is not None else None
        if failures[index] or _instance(trajectory_id) in masked_groups:
            rows.append(_masked(trajectory_id, wall, llm))
            continue
        lines = rollout.samples
        if not step_wise:
            chosen = max(range(len(lines)), key=lambda i: (sum(lines[i]["loss_mask"]), -i))
            untrained_lines += len(lines) - 1
            untrained_ids += sum(sum(line["loss_mask"]) for i, line in enumerate(lines) if i != chosen)
            lines = [lines[chosen]]
        for position, line in enumerate(lines):
            last = position == len(lines) - 1
            stop = _stop_reason(line)
            mask = list(line["loss_mask"])
            if overlong_filtering and stop != "stop":
                mask = [0] * len(mask)
            reward = float(line["reward"]) if last or not step_wise else 0.0
            ids = line["prompt_ids"], line["completion_ids"]
            rows.append(_Row(*ids, mask, line["logprobs"], reward, stop, trajectory_id, last, wall, llm))
    logprobs_whole = all(row.logprobs is not None for row in rows)
    return {
        "prompt_token_ids": [row.prompt_ids for row in rows],
        "response_ids": [row.response_ids for row in rows],
        "rewards": [row.reward for row in rows],
        "loss_masks": [row.loss_mask for row in rows],
        "stop_reasons": [row.stop_reason for row in rows],
        # SkyRL takes logprobs for every row or for none: one line without them drops them from the batch
        "rollout_logprobs": [row.logprobs for row in rows] if logprobs_whole else None,
        "trajectory_ids": [row.trajectory_id for row in rows],
        "is_last_step": [row.last for row in rows] if step_wise else None,
        "trajectory_generation_times": [row.seconds for row in rows] if seconds is not None else None,
        "trajectory_time_splits": {"llm": [row.llm_seconds for row in rows]} if llm_seconds is not None else None,
        "rollout_metrics": {
            "trajproxy/trajectories": len(rollouts),
            "trajproxy/failed_trajectories": sum(1 for why in failures if why),
            "trajproxy/masked_trajectories": sum(
                1 for t, why in zip(trajectory_ids, failures, strict=True) if why or _instance(t) in masked_groups
            ),
            "trajproxy/lines": sum(len(rollout.samples) for rollout in rollouts),
            "trajproxy/untrained_lines": untrained_lines,
            "trajproxy/untrained_ids": untrained_ids,
            "trajproxy/rows_without_logprobs": sum(1 for row in rows if row.logprobs is None),
        },
    }
