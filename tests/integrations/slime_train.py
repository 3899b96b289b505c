"""slime's train side on the CPU, for tests/integrations/slime_check.py: its reward post-processing and train-data
conversion (`RolloutManager._post_process_rewards`, `_convert_samples_to_train_data` in `slime/ray/rollout.py`) and
the flattening its `_get_rollout_data` does, run as slime's own code on the adapter's Samples.

`slime/ray/rollout.py` imports three names from SGLang (GPU only, not installed here) at its top for the engines it
starts, none of which the functions run here use: those three are stood in for, and nothing else."""

from __future__ import annotations

import itertools
import sys
import types
from argparse import Namespace
from typing import Any


def _sglang_stand_in() -> None:
    """The three SGLang names `slime/ray/rollout.py` imports at its top, for its engines (unused here)."""
    if "sglang.srt.constants" in sys.modules:
        return
    names = ("sglang", "sglang.srt", "sglang.srt.constants", "sglang.srt.server_args", "sglang.srt.utils")
    for name in names:
        sys.modules.setdefault(name, types.ModuleType(name))
    constants = sys.modules["sglang.srt.constants"]
    for kind in ("CUDA_GRAPH", "KV_CACHE", "WEIGHTS"):
        setattr(constants, f"GPU_MEMORY_TYPE_{kind}", kind.lower())
    sys.modules["sglang.srt.server_args"].ServerArgs = type("ServerArgs", (), {})  # type: ignore[attr-defined]
    sys.modules["sglang.srt.utils"].kill_process_tree = lambda *_a, **_k: None  # type: ignore[attr-defined]


def train_data(args: Namespace, groups: list[Any]) -> dict[str, Any]:
    """slime's training data for a rollout's groups (as its rollout function returns them): checked and flattened as
    `_get_rollout_data` does, then converted by `_convert_samples_to_train_data` with the post-processing that
    `args.custom_reward_post_process_path` names (slime's own when None)."""
    _sglang_stand_in()
    from slime.observability.rollout_data_utils import validate_rollout_id_annotated
    from slime.ray.rollout import RolloutManager
    from slime.utils.misc import load_function

    manager = RolloutManager.__ray_metadata__.modified_class  # the class under ray.remote
    validate_rollout_id_annotated(groups)
    data = groups
    while isinstance(data[0], list):
        data = list(itertools.chain.from_iterable(data))
    post = args.custom_reward_post_process_path
    this = types.SimpleNamespace(
        args=args,
        custom_convert_samples_to_train_data_func=None,
        custom_reward_post_process_func=load_function(post) if post else None,
    )
    this._post_process_rewards = types.MethodType(manager._post_process_rewards, this)
    made: dict[str, Any] = manager._convert_samples_to_train_data(this, data)
    keys = ("tokens", "response_lengths", "rewards", "raw_reward", "loss_masks", "rollout_ids", "sample_indices")
    return {key: made[key] for key in keys} | {"rollout_log_probs": made.get("rollout_log_probs")}
