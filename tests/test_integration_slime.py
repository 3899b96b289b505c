"""The slime adapter (integrations/slime.py) in slime's own environment, with slime's real `Sample`, `Dataset`,
rollout loop and train-data conversion: an agent's sandboxed episode, run by slime's rollout loop, becomes Samples
that are exactly the ids the engine was given and sampled, graded by the task, and slime's train data of them; a
rewritten history becomes one Sample per branch, sharing the episode's rollout id and reward; an engine that aborts
makes the episode's Samples ABORTED and slime's dynamic filter drops their group; GRPO groups count each episode
once (integrations/slime_groups.py), where slime's own post-processing would make one group of the whole batch.

SGLang needs a GPU: slime's router is stood in for by a small server in tests/integrations/slime_check.py speaking
SGLang's `/generate` shape, answered by the real vLLM on the CPU. The script runs under slime's virtualenv
(`$TRAJPROXY_TEST_SLIME_PYTHON`, else `.ci/trainer-venv slime` builds it) and prints what it saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_tokens_mode import three_turns

pytestmark = pytest.mark.timeout(1200)  # the first run on a machine builds slime's environment and the agent's bundle
ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "integrations" / "slime_check.py"
EXAMPLE = ROOT / "examples" / "tasks" / "calc" / "tasks.jsonl"
# The model is random: every call is forced to think a word, then fix the bug (the grader's tests then pass).
FIX = r"<think>[a-z]{1,6}</think>\n```bash\nsed -i 's/return a - b/return a \+ b/' calc\.py\n```"


def slime_python() -> str:
    """slime's virtualenv's python: `$TRAJPROXY_TEST_SLIME_PYTHON`, else built by `.ci/trainer-venv slime` (which
    unpacks the pinned commit's tree from `../shared/third_party` when the cache lacks it)."""
    if given := os.environ.get("TRAJPROXY_TEST_SLIME_PYTHON"):
        return given
    built = subprocess.run(["bash", ".ci/trainer-venv", "slime"], cwd=ROOT, capture_output=True, text=True, check=True)
    return built.stdout.strip().splitlines()[-1]


def check(mode: str, config: dict[str, Any], **env_vars: str) -> Any:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_vars}
    done = subprocess.run(
        [slime_python(), str(CHECK), mode, json.dumps(config)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    sys.stderr.write(done.stderr[-4000:])
    assert done.returncode == 0, done.stderr[-4000:]
    (result,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(result.removeprefix("RESULT "))


def test_slimes_rollout_runs_a_sandboxed_episode_whose_samples_are_what_the_engine_saw_and_sampled(
    vllm: Any, tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    config = {
        "vllm_url": vllm.base_url,
        "model": vllm.served_name,
        "model_dir": str(vllm.model_dir),
        "tasks": str(EXAMPLE),
        "agent": str(three_turns("minimal", tmp_path)),
        "regex": FIX,
    }
    seen = check("sandbox", config, TRAJPROXY_SLIME_LABELS=json.dumps(dict([label.split("=")])))

    (sample,) = seen["samples"]
    (line,) = seen["lines"]
    calls, turns = seen["calls"], seen["turns"]
    assert len(calls) == len(turns) == 3 and {turn["branch"] for turn in turns} == {0}
    # slime gave the sample its session id; every call was routed by it, as slime's router reads it
    assert {call["routing_key"] for call in calls} == {sample["session_id"]} and sample["session_id"]
    assert all(call["return_logprob"] is True for call in calls)
    assert calls[0]["sampling_params"]["max_new_tokens"] == 400 and calls[0]["sampling_params"]["no_stop_trim"]
    for call in calls:  # slime's response budget (--rollout-max-response-len) over the episode's calls together
        used = len(call["input_ids"]) - len(calls[0]["input_ids"])
        assert call["sampling_params"]["max_new_tokens"] == max(1, 400 - used) < 400 or call is calls[0]
    # what the engine was given and sampled is what trajproxy recorded, call by call
    for call, turn in zip(calls, turns, strict=True):
        assert (call["input_ids"], call["output_ids"]) == (turn["prompt_ids"], turn["completion_ids"])
    # the Sample is the recorded line, field for field
    assert sample["tokens"] == line["prompt_ids"] + line["completion_ids"]
    assert sample["response_length"] == len(line["completion_ids"])
    assert sample["loss_mask"] == line["loss_mask"] and sample["rollout_log_probs"] == line["logprobs"]
    assert sample["rollout_id"] == line["rollout_id"] and (sample["index"], sample["group_index"]) == (0, 0)
    assert sample["weight_versions"] == line["policy_versions"] == ["7"] * 3  # each turn's, as SGLang named them
    assert sample["label"] == "add must add" and sample["status"] == "completed" and not sample["remove_sample"]
    assert sample["metadata"]["trajproxy"]["episode_id"] == line["episode_id"]
    assert "sed -i" in sample["response"]  # the sampled text, decoded
    # the ids under loss are exactly what the engine sampled, with its logprobs; the rest are the prompts' own
    prompt_length = len(line["prompt_ids"])
    trained = [token for token, mask in zip(sample["tokens"][prompt_length:], sample["loss_mask"], strict=True) if mask]
    assert trained == [token for call in calls for token in call["output_ids"]]
    logprobs = [lp for lp, mask in zip(sample["rollout_log_probs"], sample["loss_mask"], strict=True) if mask]
    assert logprobs == [lp for call in calls for lp in call["logprobs"]]
    for call, span in zip(calls, line["turns"], strict=True):
        assert sample["tokens"][: prompt_length + span["start"]] == call["input_ids"]
    # graded by the task: the forced fix makes its tests pass
    assert {"name": "reward", "value": 1.0, "source": "grader"} in seen["rewards"]
    assert sample["reward"] == line["reward"] == 1.0
    assert seen["aborts"] >= 1  # slime's rollout loop aborted its engines at the end, through the router
    # slime's train data of it: the Sample as it is, the group of one centred to 0
    train = seen["train"]
    assert train["tokens"] == [sample["tokens"]] and train["response_lengths"] == [sample["response_length"]]
    assert train["loss_masks"] == [sample["loss_mask"]] and train["rollout_log_probs"] == [sample["rollout_log_probs"]]
    assert train["raw_reward"] == [1.0] and train["rewards"] == [0.0] and train["rollout_ids"] == [line["rollout_id"]]
    assert not engine.containers.list(all=True, filters={"label": label})


def test_a_rewritten_history_is_one_sample_per_branch_and_an_aborting_engine_makes_them_aborted(vllm: Any) -> None:
    seen = check("branches", {"vllm_url": vllm.base_url, "model": vllm.served_name, "model_dir": str(vllm.model_dir)})

    rewritten, aborted = seen["rewritten"], seen["aborted"]
    keys = ["rewrite-key"] * 3 + ["plain-0", "plain-1", "abort-key"]
    assert [call["routing_key"] for call in seen["calls"]] == keys
    lines, samples = rewritten["lines"], rewritten["samples"]
    assert [line["branch"] for line in lines] == [0, 1] and len(samples) == 2
    assert [len(line["turn_ids"]) for line in lines] == [2, 1]
    for line, sample in zip(lines, samples, strict=True):
        assert sample["tokens"] == line["prompt_ids"] + line["completion_ids"]
        assert sample["response_length"] == len(line["completion_ids"])
        assert sample["loss_mask"] == line["loss_mask"] and sum(sample["loss_mask"]) > 0
        assert sample["rollout_log_probs"] == line["logprobs"]
        assert sample["reward"] == line["reward"] == 1.0  # the episode's whole reward, as slime's agent path gives
        assert sample["rollout_id"] == line["rollout_id"] == lines[0]["rollout_id"]  # one rollout: counted once
        assert (sample["index"], sample["group_index"], sample["session_id"]) == (2, 1, "rewrite-key")
        assert sample["status"] == "completed" and sample["metadata"]["m"] == 1
        assert sample["metadata"]["trajproxy"]["turn_ids"] == line["turn_ids"]
    assert rewritten["split"] == [line["reward_split"] for line in lines] == [0.5, 0.5]  # TRAJPROXY_SLIME_REWARD=split
    # every sampled id is trained once, in its branch
    sampled = [call["output_ids"] for call in seen["calls"][:3]]
    assert sum(sum(sample["loss_mask"]) for sample in samples) == sum(map(len, sampled))

    assert seen["agent_error"] >= 500  # the aborted call failed the agent's call
    assert [turn["status"] for turn in aborted["turns"]] == ["answered", "failed"]
    (line,) = aborted["lines"]
    (sample,) = aborted["samples"]
    assert line["infrastructure_failure"] is True and line["failure_reason"]
    assert sample["status"] == "aborted" and sample["remove_sample"] is True and sample["reward"] == 0.0
    assert sample["tokens"] == line["prompt_ids"] + line["completion_ids"]
    assert sample["loss_mask"] == [0] * len(line["completion_ids"])  # dropped, never trained
    assert sample["metadata"]["trajproxy"]["failure_reason"] == line["failure_reason"]

    # two prompts' groups through slime: the group with the aborted episode is dropped by the dynamic filter
    groups = seen["groups"]
    assert groups["kept"] == [True, False]
    ours, slimes = groups["ours"], groups["slimes"]
    plain = seen["plain-0"]["samples"][0]
    assert ours["tokens"] == [s["tokens"] for s in samples] + [plain["tokens"]]
    assert ours["raw_reward"] == [1.0, 1.0, 0.0]
    assert ours["rollout_ids"][0] == ours["rollout_ids"][1] != ours["rollout_ids"][2]
    # one GRPO group of two episodes (rewards 1 and 0), the branched one counted once: +-1/sqrt(2) (std unbiased)
    assert ours["rewards"] == pytest.approx([0.5**0.5, 0.5**0.5, -(0.5**0.5)], abs=1e-5)
    # slime's own post-processing: three Samples, not n_samples_per_prompt x batch, so one group of three Samples
    assert slimes["rewards"] == pytest.approx([(1 / 3) ** 0.5, (1 / 3) ** 0.5, -2 * (1 / 3) ** 0.5], abs=1e-5)
