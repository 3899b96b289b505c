"""slime's rollout hooks for trajproxy's episodes, and the settings they need: GRPO groups per prompt that count each
episode once, however many Samples it became; groups holding an aborted episode dropped and refilled; and the check,
at the first sample, that refuses a slime configuration whose contract the episodes' Samples cannot keep.

    python train.py ... --custom-generate-function-path integrations.slime.generate \\
        --custom-reward-post-process-path integrations.slime_groups.post_process_rewards \\
        --dynamic-sampling-filter-path integrations.slime_groups.drop_aborted_groups

Why (slime @624b824, `slime/ray/rollout.py`, `slime/rollout/sglang_rollout.py`): slime normalises rewards per prompt
only when the batch holds exactly `n_samples_per_prompt` Samples per prompt, and otherwise over the whole batch as
one group, so a single branched episode (two Samples) would make every advantage of the step a whole-batch one; an
ABORTED Sample's loss is zeroed but its reward still counts in its group's mean; `--partial-rollout` resumes groups
as nested lists of Samples; `--rollout-top-p` < 1 needs top-p token ids on every Sample, which `/generate` calls
made for an agent do not return.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

GROUP_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
STD_ESTIMATORS = ("grpo", "gspo", "cispo")
POST_PROCESS = "integrations.slime_groups.post_process_rewards"
DROP_ABORTED = "integrations.slime_groups.drop_aborted_groups"
REWARD_CONVENTIONS = ("full", "split")  # TRAJPROXY_SLIME_REWARD: each Sample's reward, see `reward_convention`


class SlimeSettingsError(ValueError):
    """slime is configured in a way the episodes' Samples cannot keep to; the message says what to set."""


def reward_convention() -> str:
    """Each Sample's reward ($TRAJPROXY_SLIME_REWARD): `full` (default, as slime's own agent path does,
    `slime/agent/trajectory.py`), the episode's whole reward on each of its Samples, slime's loss counting the episode
    once by its `rollout_id`; or `split`, the reward split over the episode's trainable lines, summing to it."""
    convention = os.environ.get("TRAJPROXY_SLIME_REWARD") or "full"
    if convention not in REWARD_CONVENTIONS:
        raise SlimeSettingsError(f"TRAJPROXY_SLIME_REWARD: 'full' or 'split', not {convention!r}")
    return convention


def refusals(args: Any) -> list[str]:
    """What in slime's arguments the episodes' Samples cannot keep to, each with what to set instead."""
    why = []
    if getattr(args, "partial_rollout", False):
        why.append(
            "--partial-rollout: an episode is one agent's whole run in a sandbox and cannot be resumed from the "
            "Samples it left; run without it (an episode cut by a weight update is aborted, and its group dropped)"
        )
    if float(getattr(args, "rollout_top_p", 1.0)) != 1.0:
        why.append(
            "--rollout-top-p below 1: slime's training then needs each sampled id's top-p token ids, which an "
            "agent's calls do not return; use --rollout-top-p 1.0"
        )
    grouped = getattr(args, "advantage_estimator", None) in GROUP_ESTIMATORS and getattr(
        args, "rewards_normalization", False
    )
    if grouped and getattr(args, "custom_reward_post_process_path", None) != POST_PROCESS:
        why.append(
            f"--custom-reward-post-process-path {POST_PROCESS}: slime groups rewards per prompt only when each prompt "
            "has exactly n_samples_per_prompt Samples, and an episode that branched is several"
        )
    if getattr(args, "dynamic_sampling_filter_path", None) is None:
        why.append(
            f"--dynamic-sampling-filter-path {DROP_ABORTED}: a group with an aborted episode (a lost sandbox, an "
            "engine abort) would be scored with it (call it first in a filter of your own)"
        )
    return why


def check(args: Any) -> None:
    """Raise SlimeSettingsError, naming every setting to change, where `refusals` finds any."""
    reward_convention()
    if why := refusals(args):
        raise SlimeSettingsError("trajproxy's slime adapter cannot run with " + "; ".join(why))


def aborted(sample: Any) -> bool:
    return bool(sample.remove_sample) or getattr(sample.status, "value", sample.status) == "aborted"


def _flat(group: Sequence[Any]) -> list[Any]:
    return [sample for item in group for sample in (item if isinstance(item, list) else [item])]


def drop_aborted_groups(args: Any, group: Sequence[Any], **_: Any) -> Any:
    """slime's dynamic sampling filter: drop a prompt's group when any of its episodes was aborted (slime then
    samples another prompt to fill the batch, as its fully asynchronous rollout re-queues aborted groups)."""
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput  # lazy: slime loads only in its run

    if any(aborted(sample) for sample in _flat(group)):
        return DynamicFilterOutput(keep=False, reason="trajproxy_aborted_episode")
    return DynamicFilterOutput(keep=True)


def post_process_rewards(args: Any, samples: Sequence[Any]) -> tuple[list[float], list[float]]:
    """slime's reward post-processing for episodes' Samples: with a group estimator (GRPO, ...) and reward
    normalisation, each prompt's group (`group_index`) is normalised over its episodes, each counted once (its Samples
    share a `rollout_id`) with its whole reward, aborted ones left out; each Sample gets its episode's advantage (its
    share of it, under the `split` convention); an aborted Sample gets 0.0. Otherwise the rewards as they are."""
    raw = [float(sample.get_reward_value(args)) for sample in samples]
    if not (args.advantage_estimator in GROUP_ESTIMATORS and args.rewards_normalization):
        return raw, list(raw)
    episode_of = [
        sample.rollout_id if sample.rollout_id is not None else ("sample", i) for i, sample in enumerate(samples)
    ]
    whole: dict[Any, float] = {}
    group_of: dict[Any, Any] = {}
    count: dict[Any, int] = {}
    for sample, episode, value in zip(samples, episode_of, raw, strict=True):
        count[episode] = count.get(episode, 0) + 1
        if aborted(sample) or episode in whole:
            continue
        info = (sample.metadata or {}).get("trajproxy") or {}
        whole[episode] = float(info["reward"]) if info.get("reward") is not None else value
        group_of[episode] = sample.group_index
    members: dict[Any, list[float]] = {}
    for episode, reward in whole.items():
        members.setdefault(group_of[episode], []).append(reward)
    scale = args.advantage_estimator in STD_ESTIMATORS and getattr(args, "grpo_std_normalization", False)
    advantage = {}
    for episode, reward in whole.items():
        rewards = members[group_of[episode]]
        centred = reward - statistics.fmean(rewards)
        spread = statistics.stdev(rewards) if len(rewards) > 1 else 0.0  # torch's std, unbiased, as slime's
        advantage[episode] = centred / (spread + 1e-6) if scale else centred
    split = reward_convention() == "split"
    rewards = [
        0.0 if episode not in advantage else advantage[episode] / (count[episode] if split else 1)
        for episode in episode_of
    ]
    return raw, rewards
