"""verl's agent loop (integrations/verl.py) in verl 0.9.1's own worker, with the real vLLM on the CPU as verl's engine:
a sandboxed agent's episode comes back to verl as exactly the ids the engine sampled and trajproxy recorded, an
episode of several branches maps line for line, and verl's own padding keeps every mask. Each check runs in verl's
environment (tests/integrations/verl_check.py) and prints what it saw."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.test_tokens_mode import SANDBOXED, three_turns

pytestmark = pytest.mark.timeout(900)  # the first test using vllm waits for it; verl's venv may be built
ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "integrations" / "verl_check.py"
EXAMPLE = ROOT / "examples" / "tasks" / "calc" / "tasks.jsonl"
RESPONSE_LENGTH = 1024  # verl_check.py's rollout.response_length


def verl_python() -> str:
    """verl's environment: $TRAJPROXY_TEST_VERL_PYTHON, else the one `.ci/trainer-venv verl` builds (or finds)."""
    if python := os.environ.get("TRAJPROXY_TEST_VERL_PYTHON"):
        return python
    built = subprocess.run(
        ["bash", str(ROOT / ".ci" / "trainer-venv"), "verl"], capture_output=True, text=True, timeout=1800
    )
    assert built.returncode == 0, f"verl's environment could not be built: {built.stderr[-3000:]}"
    return built.stdout.strip().splitlines()[-1]


def check(mode: str, **args: Any) -> Any:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [verl_python(), str(CHECK), mode, json.dumps(args)], capture_output=True, text=True, timeout=800, env=env
    )
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def spans_of(requests: list[dict[str, Any]], prompt: list[int], response: list[int]) -> list[int]:
    """The mask the engine's calls make of a sequence: 1 where each call's sampled ids lie, after its prompt."""
    sequence, mask = prompt + response, [0] * len(response)
    for request in requests:
        start = len(request["prompt_ids"])
        assert sequence[:start] == request["prompt_ids"]  # each call's prompt is the sequence so far
        assert sequence[start : start + len(request["token_ids"])] == request["token_ids"]
        mask[start - len(prompt) : start - len(prompt) + len(request["token_ids"])] = [1] * len(request["token_ids"])
    return mask


def assert_padded(padded: dict[str, Any], row: int, output: dict[str, Any]) -> None:
    """verl's padded row holds the output: response ids, mask and logprobs right-padded, the prompt left-padded, the
    reward on the last response id."""
    tensors, n = padded["tensors"], len(output["response_ids"])
    assert tensors["responses"][row][:n] == output["response_ids"]
    assert tensors["response_mask"][row] == output["response_mask"] + [0] * (RESPONSE_LENGTH - n)
    assert tensors["rollout_log_probs"][row] == pytest.approx(
        output["response_logprobs"] + [0.0] * (RESPONSE_LENGTH - n)
    )
    prompt = output["prompt_ids"]
    assert tensors["prompts"][row][len(tensors["prompts"][row]) - len(prompt) :] == prompt
    attention = tensors["attention_mask"][row]
    assert sum(attention) == len(prompt) + n
    scores = tensors["rm_scores"][row]
    assert scores[n - 1] == output["reward_score"] and sum(scores) == output["reward_score"]


def test_the_agent_loop_runs_a_sandboxed_agent_through_verls_engine_and_returns_what_it_sampled(
    vllm: Any, tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    name, value = label.split("=")
    agent = str(three_turns("minimal", tmp_path))
    got = check(
        "loop",
        folder=str(tmp_path),
        model_dir=str(vllm.model_dir),
        base_url=vllm.base_url,
        model=vllm.served_name,
        tasks=str(EXAMPLE),
        agent=agent,
        regex=SANDBOXED["minimal"][0],
        labels={name: value},
    )
    assert got["type"] == "TrajproxyAgentLoop"  # made from verl's registry, as its worker makes loops
    output, requests, recorded = got["output"], got["requests"], got["recorded"]
    info = output["extra_fields"]["trajproxy"]

    # three calls, all under the rollout's one sticky request id, with verl's sampling and the episode's own
    assert len(requests) == 3 and len({r["request_id"] for r in requests}) == 1
    for request in requests:
        params = request["sampling_params"]
        assert params["temperature"] == 1.0 and params["logprobs"] is True and params["seed"] == 5
        assert 1 <= params["max_tokens"] <= 160 and "regex" in params["structured_outputs"]
        # verl's vLLM server builds SamplingParams(**params): each name one of its fields, the constraint its type
        assert request["structured_outputs_type"] == "StructuredOutputsParams"
    # the verl user's custom_chat_template renders the prompts, not the template on disk
    assert got["first_text"].startswith("verl-custom-template\n")

    # the output is the episode's recorded ids, field for field
    turns = recorded["turns"]
    assert [turn["branch"] for turn in turns] == [0, 0, 0]
    assert output["prompt_ids"] == turns[0]["prompt_ids"] == requests[0]["prompt_ids"]
    assert [turn["completion_ids"] for turn in turns] == [r["token_ids"] for r in requests]
    assert output["prompt_ids"] + output["response_ids"] == requests[-1]["prompt_ids"] + requests[-1]["token_ids"]
    mask = spans_of(requests, output["prompt_ids"], output["response_ids"])
    assert output["response_mask"] == mask  # 1 on exactly the ids the engine sampled
    sampled = [i for i, m in zip(output["response_ids"], mask, strict=True) if m]
    assert sampled == [i for r in requests for i in r["token_ids"]]
    logprobs = [lp for lp, m in zip(output["response_logprobs"], mask, strict=True) if m]
    assert logprobs == pytest.approx([lp for r in requests for lp in r["log_probs"]])
    assert all(lp == 0.0 for lp, m in zip(output["response_logprobs"], mask, strict=True) if not m)

    # the grader's reward (three turns used up, the task undone), and what the episode was
    grader = [value for name, value, source in recorded["rewards"] if source == "grader" and name == "reward"]
    assert grader == [0.0] and output["reward_score"] == 0.0
    assert output["num_turns"] == 6 and output["metrics"]["generate_sequences"] > 0
    assert info["branch"] == 0 and info["lines"] == 1 and info["untrained_lines"] == []
    assert info["infrastructure_failure"] is False and info["response_cut"] == 0 and info["prompt_cut"] == 0
    assert output["extra_fields"]["min_global_steps"] == output["extra_fields"]["max_global_steps"] == 7
    assert info["policy_versions"] == ["7"] * 3  # verl's global steps, each turn's policy version
    assert info["logprobs_missing"] is False

    # verl's own padding into its batch keeps the masks
    assert_padded(got["padded"], 0, output)
    assert got["padded"]["extra"][0]["episode_id"] == info["episode_id"]

    # and verl's worker, given a batch of two such rows, runs them through the loop one episode at a time (the loop's
    # max_episodes: 1): each row holds exactly what the engine sampled, at loss, and the grader's reward
    batch = got["batch"]
    assert len(batch["extra"]) == 2 and all(row["infrastructure_failure"] is False for row in batch["extra"])
    assert info["episode_id"] not in {row["episode_id"] for row in batch["extra"]}
    tensors, requests = batch["tensors"], batch["requests"]
    keys = [r["request_id"] for r in requests]
    assert len(keys) == 6 and keys == [keys[0]] * 3 + [keys[3]] * 3 and keys[0] != keys[3]  # never interleaved
    assert got["requests"][0]["request_id"] not in keys  # a key of its own
    for row, own in enumerate((requests[:3], requests[3:])):
        n = sum(tensors["attention_mask"][row]) - len(own[0]["prompt_ids"])
        response, mask = tensors["responses"][row][:n], tensors["response_mask"][row]
        assert mask[n:] == [0] * (RESPONSE_LENGTH - n)
        assert mask[:n] == spans_of(own, own[0]["prompt_ids"], response)
        assert tensors["rm_scores"][row][n - 1] == 0.0 and "rollout_log_probs" in tensors
    assert not engine.containers.list(all=True, filters={"label": label})


def test_an_episode_of_two_branches_maps_line_for_line_and_verls_padding_keeps_each_mask(
    vllm: Any, tmp_path: Path
) -> None:
    got = check(
        "branches", folder=str(tmp_path), model_dir=str(vllm.model_dir), base_url=vllm.base_url, model=vllm.served_name
    )
    samples, mapped, calls = got["samples"], got["mapped"], got["calls"]
    assert [line["branch"] for line in samples] == [0, 1]  # the rewritten history opened a second branch
    assert [len(line["turn_ids"]) for line in samples] == [2, 2]

    # every line, field for field
    outputs = mapped["all"]
    for line, output in zip(samples, outputs, strict=True):
        assert output["prompt_ids"] == line["prompt_ids"]
        assert output["response_ids"] == line["completion_ids"]
        assert output["response_mask"] == line["loss_mask"]
        assert output["response_logprobs"] == line["logprobs"]
        assert output["reward_score"] == line["reward"] == 0.5
        assert output["num_turns"] == 4
        info = output["extra_fields"]["trajproxy"]
        assert (info["branch"], info["turn_ids"], info["lines"]) == (line["branch"], line["turn_ids"], 2)
    # each sampled id trained once, across the lines, and only there
    assert sum(sum(o["response_mask"]) for o in outputs) == sum(len(call["token_ids"]) for call in calls)
    for line, own in zip(samples, (calls[:2], calls[2:]), strict=True):
        assert line["loss_mask"] == spans_of(own, line["prompt_ids"], line["completion_ids"])

    # one sequence per run: the line with the most sampled ids, the other reported untrained
    (main,) = mapped["main"]
    kept = max(samples, key=lambda line: (sum(line["loss_mask"]), -line["branch"]))
    other = samples[1 - samples.index(kept)]
    assert main["response_ids"] == kept["completion_ids"]
    assert main["extra_fields"]["trajproxy"]["untrained_lines"] == [
        {"branch": other["branch"], "turn_ids": other["turn_ids"], "sampled_ids": sum(other["loss_mask"])}
    ]

    # verl's length limits: the prompt cut from the left, the response from the right, and said
    for line, cut in zip(samples, got["cut"], strict=True):
        assert cut["prompt_ids"] == line["prompt_ids"][-8:] and cut["response_ids"] == line["completion_ids"][:5]
        assert cut["response_mask"] == line["loss_mask"][:5]
        info = cut["extra_fields"]["trajproxy"]
        assert info["prompt_cut"] == len(line["prompt_ids"]) - 8
        assert info["response_cut"] == len(line["completion_ids"]) - 5 and info["stop_reason"] == "length"

    # a rollout that failed before any call: one sequence at no loss, reward 0, flagged
    (failed,) = got["failed"]
    assert failed["prompt_ids"] == [5, 6] and failed["response_mask"] == [0] * len(failed["response_ids"])
    assert failed["reward_score"] == 0.0
    assert failed["extra_fields"]["trajproxy"]["infrastructure_failure"] is True
    assert failed["extra_fields"]["trajproxy"]["failure_reason"] == "the sandbox could not start"

    for row, output in enumerate([*outputs, failed]):
        assert_padded(got["padded"], row, output)

    # what verl's vLLM server cannot take is refused before any episode, by name; a constraint given as vLLM's HTTP
    # API spells it becomes the type SamplingParams needs
    assert got["refused"].startswith("sampling option(s) regex: verl's vLLM server passes")
    assert got["converted"] == "StructuredOutputsParams"
