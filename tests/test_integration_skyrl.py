"""The SkyRL adapter (integrations/skyrl.py, integrations/skyrl_outputs.py): its generator's real `generate`, in SkyRL
0.4's own venv on Python 3.12 with SkyRL's own remote inference client answering the minimal agent's calls in Docker
sandboxes through a real vLLM, gives the episodes' recorded ids field for field, SkyRL's salt and time splits, and
passes SkyRL's validation; a recorded episode with two branches maps to one row or to step-wise rows; SkyRL's side
channels it cannot return are refused; failures are masked as SkyRL's Harbor generator masks them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from integrations.rollouts import Rollout
from integrations.skyrl import episode_sampling
from integrations.skyrl_outputs import generator_output
from testkit.tasks import EXAMPLE, ROOT
from testkit.vllm_server import VllmServer

# the first run on a machine builds SkyRL's venv (.ci/trainer-venv skyrl: torch and its CUDA libraries from PyPI,
# 3.6 GB; about 30 s with uv) and starts vLLM
pytestmark = pytest.mark.timeout(1800)
CHECK = ROOT / "tests" / "integrations" / "skyrl_check.py"
NEVER_DONE = r"```bash\n(ls|pwd|cat calc.py)\n```"  # a command each turn, never the agent's TASK_COMPLETE
TURNS = 3


@pytest.fixture(scope="module")
def skyrl_python() -> str:
    """SkyRL's venv: $TRAJPROXY_TEST_SKYRL_PYTHON, else the one .ci/trainer-venv builds (once per machine)."""
    if python := os.environ.get("TRAJPROXY_TEST_SKYRL_PYTHON"):
        return python
    done = subprocess.run(["bash", str(ROOT / ".ci" / "trainer-venv"), "skyrl"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def scale_out_vllm(vllm: VllmServer) -> VllmServer:
    """The session's vLLM, which serves /inference/v1/generate, the endpoint SkyRL's RemoteInferenceClient samples
    from (its flags carry --enable-scale-out)."""
    probe = httpx.post(f"{vllm.root_url}/inference/v1/generate", json={}, timeout=30)
    assert probe.status_code in (400, 422), probe.text  # the route is there and refuses an empty request
    return vllm


def check(python: str, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [python, str(CHECK), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"},
    )
    assert done.returncode == 0, done.stderr[-5000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def minimal_agent_of(turns: int, folder: Path) -> Path:
    """The minimal agent's manifest with `--max-turns` (the same bundle: a command is not part of it)."""
    shutil.copytree(ROOT / "agents" / "minimal", folder / "minimal")
    text = (ROOT / "agents" / "minimal.toml").read_text()
    manifest = folder / "minimal.toml"
    manifest.write_text(text.replace("--model {model}", f"--model {{model}} --max-turns {turns}"))
    return manifest


def stitched(turns: list[dict[str, Any]]) -> tuple[list[int], list[int], list[float]]:
    """What one linear conversation's turns make, by hand: each call's sampled ids after the first prompt, with the
    ids each later prompt added between them; the mask and logprobs that go with them."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    first = turns[0]["prompt_token_ids"]
    for turn in turns:
        added = turn["prompt_token_ids"][len(first) + len(ids) :]
        assert turn["prompt_token_ids"] == first + ids + added  # every prompt continues the one before
        ids += added + turn["completion_token_ids"]
        mask += [0] * len(added) + [1] * len(turn["completion_token_ids"])
        logprobs += [0.0] * len(added) + turn["logprobs"]
    return ids, mask, logprobs


def test_the_generators_generate_gives_the_recorded_episodes_field_for_field(
    skyrl_python: str, scale_out_vllm: VllmServer, task_image: str, tmp_path: Path
) -> None:
    server = scale_out_vllm
    tasks = tmp_path / "tasks.jsonl"
    shutil.copy(EXAMPLE / "tasks.jsonl", tasks)
    agent = minimal_agent_of(TURNS, tmp_path)
    database = str(tmp_path / "skyrl.db")
    got = check(
        skyrl_python, "generate", server.root_url, str(server.model_dir), server.served_name, database,
        str(tasks), str(agent), NEVER_DONE,
    )  # fmt: skip
    output, episodes = got["output"], {e["metadata"]["rollout_key"]: e for e in got["episodes"]}
    keys = ["check-train-step7-calc_0", "check-train-step7-calc_1"]
    assert sorted(episodes) == keys and output["trajectory_ids"] == ["calc_0", "calc_1"]
    for row, key in enumerate(keys):
        episode = episodes[key]
        turns = episode["turns"]
        assert len(turns) == TURNS and {turn["branch"] for turn in turns} == {0}
        assert {turn["policy_version"] for turn in turns} == {"0"}  # the client's weight version: no sync yet
        assert episode["metadata"]["skyrl"] == {
            "run": "check", "global_step": 7, "phase": "train", "trajectory_id": f"calc_{row}", "weights": got["salt"],
        }  # fmt: skip
        ids, mask, logprobs = stitched(turns)
        assert output["prompt_token_ids"][row] == turns[0]["prompt_token_ids"]
        assert output["response_ids"][row] == ids
        assert output["loss_masks"][row] == mask
        assert output["rollout_logprobs"][row] == logprobs
        [grader] = [r["value"] for r in episode["rewards"] if r["source"] == "grader" and r["name"] == "reward"]
        assert output["rewards"][row] == grader == 0.0  # graded, the bug left: not an infrastructure failure
        assert output["stop_reasons"][row] == "stop"
        assert 0 < output["trajectory_time_splits"]["llm"][row] < output["trajectory_generation_times"][row]
        for turn in turns:  # mask-1 ids are what vLLM samples for that prompt with the batch's own sampling
            again = resample(server, turn["prompt_token_ids"], got["sampling"])
            assert again == turn["completion_token_ids"]
    assert output["is_last_step"] is None
    metrics = output["rollout_metrics"]
    assert metrics["trajproxy/masked_trajectories"] == 0 and metrics["trajproxy/lines"] == 2
    assert metrics["generate/avg_num_tokens"] == sum(map(len, output["response_ids"])) / 2  # SkyRL's own metrics
    llm = output["trajectory_time_splits"]["llm"]
    assert metrics["generate/trajectory_time_llm_mean"] == pytest.approx(sum(llm) / 2)
    assert got["salt"] == "0"  # the prefix-cache salt SkyRL's own generator sends at weight version 0, and trajproxy's


def resample(server: VllmServer, prompt_ids: list[int], sampling: dict[str, Any]) -> list[int]:
    body = {"model": server.served_name, "token_ids": prompt_ids, "sampling_params": episode_sampling(sampling)}
    answer = httpx.post(f"{server.root_url}/inference/v1/generate", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    ids: list[int] = answer.json()["choices"][0]["token_ids"]
    return ids


def test_a_branched_episode_is_one_row_or_a_step_wise_row_per_line(
    skyrl_python: str, scale_out_vllm: VllmServer, tmp_path: Path
) -> None:
    server = scale_out_vllm
    got = check(
        skyrl_python, "branches", server.root_url, str(server.model_dir), server.served_name,
        str(tmp_path / "branches.db"), "(red|green|blue)",
    )  # fmt: skip
    samples, turns = got["samples"], got["episode"]["turns"]
    assert [turn["branch"] for turn in turns] == [0, 0, 1]
    main, rewritten = samples
    assert main["turn_ids"] == [turns[0]["id"], turns[1]["id"]] and rewritten["turn_ids"] == [turns[2]["id"]]
    ids, mask, logprobs = stitched(turns[:2])
    assert (main["prompt_ids"], main["completion_ids"], main["loss_mask"]) == (turns[0]["prompt_token_ids"], ids, mask)
    assert main["logprobs"] == logprobs
    assert rewritten["prompt_ids"] == turns[2]["prompt_token_ids"]

    one = got["one_row"]  # SkyRL without step-wise training: the line with the most trainable ids
    assert one["prompt_token_ids"] == [main["prompt_ids"]] and one["response_ids"] == [main["completion_ids"]]
    assert one["loss_masks"] == [main["loss_mask"]] and one["rollout_logprobs"] == [main["logprobs"]]
    assert one["rewards"] == [0.5] and one["trajectory_ids"] == ["colours_0"] and one["is_last_step"] is None
    metrics = one["rollout_metrics"]
    assert metrics["trajproxy/untrained_lines"] == 1
    assert metrics["trajproxy/untrained_ids"] == len(turns[2]["completion_token_ids"])

    steps = got["step_wise"]  # step-wise: every line a row of the trajectory, the return on the last
    assert steps["prompt_token_ids"] == [line["prompt_ids"] for line in samples]
    assert steps["response_ids"] == [line["completion_ids"] for line in samples]
    assert steps["loss_masks"] == [line["loss_mask"] for line in samples]
    assert steps["rollout_logprobs"] == [line["logprobs"] for line in samples]
    assert steps["is_last_step"] == [False, True] and steps["rewards"] == [0.0, 0.5]
    assert steps["trajectory_ids"] == ["colours_0", "colours_0"]
    trained = sum(sum(mask) for mask in steps["loss_masks"])
    assert trained == sum(len(turn["completion_token_ids"]) for turn in turns)  # each sampled id once

    # max_total_length: the first prompt and all that follows within it; each call held to what is left, at least 1
    capped = got["capped"]
    assert 1 <= capped["first"] <= 6 and 1 <= capped["second"] <= max(1, 6 - capped["first"] - 2)
    assert capped["version"] == 0  # SkyRL's client's weight version, each turn's policy version

    # SkyRL's per-token side channels the generator cannot return are refused when it is made, each named
    assert got["refused"] == {
        option: f"TrajproxyGenerator returns no {what}: set generator.inference_engine.{option}=false"
        for option, what in [
            ("enable_return_routed_experts", "routed experts (R3)"),
            ("enable_return_sample_support_set", "sampler support sets"),
        ]
    }


# The mapping alone, on lines as the export writes them (no SkyRL needed): failures, logprobs, lengths.


def line(
    reward: float | None, *, failure: str | None = None, stop: str = "stop", logprobs: bool = True
) -> dict[str, Any]:
    return {
        "prompt_ids": [5, 6],
        "completion_ids": [7, 8, 9],
        "loss_mask": [1, 0, 1],
        "logprobs": [-0.5, 0.0, -0.25] if logprobs else None,
        "stop_reason": stop,
        "reward": reward,
        "infrastructure_failure": failure is not None,
        "failure_reason": failure,
    }


def rollout(*lines: dict[str, Any], reason: str = "") -> Rollout:
    return Rollout("k", "ep" if lines else None, "finished" if lines else "failed", None, reason, list(lines))


def test_an_infrastructure_failure_masks_its_prompts_group_and_no_other() -> None:
    rollouts = [rollout(line(1.0)), rollout(line(None, failure="sandbox lost")), rollout(line(1.0))]
    out = generator_output(rollouts, ["a", "a", "b"])
    assert out["loss_masks"] == [[0], [0], [1, 0, 1]] and out["rewards"] == [0.0, 0.0, 1.0]
    assert out["stop_reasons"] == ["error", "error", "stop"] and out["response_ids"][2] == [7, 8, 9]
    assert out["rollout_metrics"]["trajproxy/failed_trajectories"] == 1
    assert out["rollout_metrics"]["trajproxy/masked_trajectories"] == 2
    alone = generator_output(rollouts, ["a", "a", "b"], mask_failed_groups=False)
    assert alone["loss_masks"] == [[1, 0, 1], [0], [1, 0, 1]]


def test_a_rollout_with_no_lines_is_a_placeholder_and_one_line_without_logprobs_drops_them() -> None:
    out = generator_output([rollout(reason="the rollout raised"), rollout(line(0.0, logprobs=False))], ["a", "b"])
    assert out["prompt_token_ids"] == [[0], [5, 6]] and out["loss_masks"] == [[0], [1, 0, 1]]
    assert out["rollout_logprobs"] is None and out["rollout_metrics"]["trajproxy/rows_without_logprobs"] == 1


def test_a_reply_cut_by_length_says_so_and_overlong_filtering_takes_its_loss() -> None:
    rollouts = [rollout(line(1.0, stop="length")), rollout(line(1.0, stop="tool_calls"))]
    assert generator_output(rollouts, ["a", "b"])["stop_reasons"] == ["length", "stop"]
    filtered = generator_output(rollouts, ["a", "b"], overlong_filtering=True)
    assert filtered["loss_masks"] == [[0, 0, 0], [1, 0, 1]]


def test_an_ungraded_rollout_is_masked_with_its_group() -> None:
    """An episode that ended with no reward (its grader never ran), yet no infrastructure failure: SkyRL gets no score
    to train it by, so it is masked, and its group with it."""
    rollouts = [rollout(line(None)), rollout(line(1.0)), rollout(line(0.0))]
    out = generator_output(rollouts, ["a", "a", "b"])
    assert out["loss_masks"] == [[0], [0], [1, 0, 1]] and out["stop_reasons"] == ["error", "error", "stop"]
    assert out["rollout_metrics"]["trajproxy/failed_trajectories"] == 1


def test_one_row_per_trajectory_trains_the_line_with_the_most_sampled_ids_whichever_comes_first() -> None:
    few = line(1.0)  # two sampled ids
    many = {**line(1.0), "completion_ids": [7, 8, 9, 10], "loss_mask": [1, 1, 0, 1], "logprobs": [-0.5] * 4}
    out = generator_output([rollout(few, many), rollout(many, few)], ["a", "b"])
    assert out["response_ids"] == [[7, 8, 9, 10], [7, 8, 9, 10]] and out["loss_masks"] == [[1, 1, 0, 1]] * 2
    assert out["rollout_metrics"]["trajproxy/untrained_lines"] == 2
    assert out["rollout_metrics"]["trajproxy/untrained_ids"] == 4
    tied = generator_output([rollout(line(1.0), {**line(1.0), "completion_ids": [1, 2, 3]})], ["a"])
    assert tied["response_ids"] == [[7, 8, 9]]  # of equals, the earliest
