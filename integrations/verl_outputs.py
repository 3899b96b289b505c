"""verl's `AgentLoopOutput` fields made from an episode's sample lines (`proxy/storage/sample.schema.json`): a plain
mapping with no verl import, so that it is tested where verl is not installed (integrations/verl.py uses it).

Logprobs are never made up. verl takes a batch's rollout logprobs from every row or from none (it stacks them when
its first row has them), so a line without them, where verl asked for them, keeps its ids with no loss and is
flagged (`logprobs_missing`): its sampled ids are not trained with an importance ratio against zeros. The only 0.0
logprobs in an output lie where nothing is trained: the environment's ids, verl's padding, a failure's ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from integrations.rollouts import Rollout

__all__ = ["agent_loop_output", "agent_loop_outputs", "policy_version"]


def agent_loop_output(
    line: dict[str, Any], *, prompt_length: int, response_length: int, logprobs: bool
) -> dict[str, Any]:
    """The fields of verl's AgentLoopOutput for one sample line (all but metrics): the line's ids as they are, the
    prompt left-cut to `prompt_length` (as verl cuts its own), the response cut to `response_length` (verl pads to it
    and cannot take more: the cut ids are lost, counted in `response_cut`). An infrastructure failure keeps its ids
    with no loss and reward 0.0 (verl has no status to drop a sequence by): flagged, for a filter to drop it. A line
    without logprobs, where verl asked for them (`logprobs`), keeps its ids with no loss (the module's docstring)."""
    prompt, completion = list(line["prompt_ids"]), list(line["completion_ids"])
    failed = bool(line["infrastructure_failure"])
    missing = logprobs and line["logprobs"] is None and not failed
    mask = [0] * len(completion) if failed or missing else list(line["loss_mask"])
    # where nothing is trained, 0.0 is padding (as verl pads); a trained id always has the engine's own logprob
    rollout_logprobs = line["logprobs"] if line["logprobs"] is not None else [0.0] * len(completion)
    reward = 0.0 if failed else line["reward"]
    prompt_cut = max(0, len(prompt) - prompt_length)
    response_cut = max(0, len(completion) - response_length)
    info = {
        "episode_id": line["episode_id"],
        "rollout_id": line["rollout_id"],
        "status": line["status"],
        "branch": line["branch"],
        "turn_ids": list(line["turn_ids"]),
        "policy_versions": list(line["policy_versions"]),
        "stop_reason": "length" if response_cut else line["stop_reason"],
        "rewards": dict(line["rewards"]),
        "reward_split": line["reward_split"],
        "drifts": len(line["drifts"]),
        "stale_turns": line["stale_turns"],
        "prompt_cut": prompt_cut,
        "response_cut": response_cut,
        "trained_cut": sum(mask[response_length:]),
        "infrastructure_failure": failed,
        "logprobs_missing": missing,
        "failure_reason": line["failure_reason"],
    }
    return {
        "prompt_ids": prompt[prompt_cut:],
        "response_ids": completion[:response_length],
        "response_mask": mask[:response_length],
        "response_logprobs": rollout_logprobs[:response_length] if logprobs else None,
        "reward_score": reward,
        "num_turns": 2 * len(line["turns"]),  # each call: the messages before it, and its reply
        # verl's v1 worker copies the last output's reward_extra_info to its others when the loop gave the reward
        "extra_fields": {"trajproxy": info, "reward_extra_info": {}},
    }


def agent_loop_outputs(
    rollout: Rollout,
    *,
    prompt_length: int,
    response_length: int,
    logprobs: bool,
    branches: str = "main",
    fallback_prompt_ids: list[int] | None = None,
    pad_id: int = 0,
) -> list[dict[str, Any]]:
    """The AgentLoopOutput fields of a rollout: with `branches="main"` one, its main line (the most sampled ids, the
    earliest of equals), the others named in `untrained_lines`; with "all" one per line, in branch order but the main
    line last: verl's v1 worker takes a run's last output for the whole run (its GRPO advantage, read at the first
    trained id, goes to every output; the reward function and a teacher's logprobs see it alone). A rollout without
    any line (its sandbox or task failed before the agent's first call) is one failed sequence: the fallback prompt,
    one pad id at no loss, reward 0.0."""
    lines = rollout.samples
    if not lines:
        prompt = list(fallback_prompt_ids or [pad_id])
        line = {
            "prompt_ids": prompt,
            "completion_ids": [pad_id],
            "loss_mask": [0],
            "logprobs": [0.0],
            "turns": [],
            "turn_ids": [],
            "policy_versions": [],
            "branch": 0,
            "stop_reason": None,
            "drifts": [],
            "stale_turns": 0,
            "reward": None,
            "reward_split": None,
            "rewards": {},
            "rollout_id": None,
            "episode_id": rollout.episode_id,
            "status": rollout.status,
            "infrastructure_failure": True,
            "failure_reason": rollout.reason or f"the episode {rollout.status} before any call",
        }
        lines = [line]
    main = max(lines, key=lambda line: (sum(line["loss_mask"]), -lines.index(line)))
    if branches == "all":
        chosen = [line for line in lines if line is not main] + [main]
    elif branches == "main":
        chosen = [main]
    else:
        raise ValueError(f"branches: 'main' or 'all', not {branches!r}")
    outputs = [
        agent_loop_output(line, prompt_length=prompt_length, response_length=response_length, logprobs=logprobs)
        for line in chosen
    ]
    untrained = [
        {"branch": line["branch"], "turn_ids": list(line["turn_ids"]), "sampled_ids": sum(line["loss_mask"])}
        for line in lines
        if not any(line is kept for kept in chosen)
    ]
    for output in outputs:
        output["extra_fields"]["trajproxy"]["lines"] = len(rollout.samples)
        output["extra_fields"]["trajproxy"]["untrained_lines"] = untrained
    return outputs


def policy_version(extra_fields: Mapping[str, Any]) -> str | None:
    """The weights that sampled a call, as verl names them: the engine's `global_steps` (the trainer step whose
    weights it holds; the newest, where a call resumed across an update), as the turn's policy version."""
    for name in ("max_global_steps", "global_steps"):
        steps = extra_fields.get(name)
        if isinstance(steps, int) and not isinstance(steps, bool):
            return str(steps)
    return None
