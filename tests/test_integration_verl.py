"""verl's agent loop (integrations/verl.py) in verl 0.9.1's own worker, with the real vLLM on the CPU as verl's engine:
a sandboxed agent's episode comes back to verl as exactly the ids the engine sampled and trajproxy recorded, an
episode of several branches maps line for line, and verl's own padding keeps every mask. Each check runs in verl's
environment (tests/integrations/verl_check.py) and prints what it saw."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.test_tokens_mode import PRESETS, SANDBOXED, three_turns

pytestmark = pytest.mark.timeout(900)  # the first test using vllm waits for it; verl's venv may be built
ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "integrations" / "verl_check.py"
V1_CHECK = ROOT / "tests" / "integrations" / "verl_v1_check.py"
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
    """What a check in verl's environment printed last: verl_check.py's `mode`, or verl_v1_check.py's ("v1")."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # no cluster is there: Ray would join it (or the last one any test started here) unless told to start its own
    env["RAY_ADDRESS"] = "127.0.0.1:9"
    argv = [str(V1_CHECK)] if mode == "v1" else [str(CHECK), mode]
    done = subprocess.run(
        [verl_python(), *argv, json.dumps(args)], capture_output=True, text=True, timeout=800, env=env
    )
    assert done.returncode == 0, done.stderr[-5000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    got["stderr"] = done.stderr[-5000:]  # what verl's workers logged, for a failed assertion to show
    return got


def sandboxed(mode: str, vllm: Any, folder: Path, agent: Path, label: str) -> Any:
    """A check whose episodes run `agent` (a minimal agent's manifest) on the example task in sandboxes labelled
    `label`, its calls held to the minimal agent's commands (SANDBOXED)."""
    name, value = label.split("=")
    return check(
        mode,
        folder=str(folder),
        model_dir=str(vllm.model_dir),
        base_url=vllm.base_url,
        model=vllm.served_name,
        tasks=str(EXAMPLE),
        agent=str(agent),
        regex=SANDBOXED["minimal"][0],
        labels={name: value},
    )


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
    got = sandboxed("loop", vllm, tmp_path, three_turns("minimal", tmp_path), label)
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

    # every line, field for field, the main line (the most sampled ids) last: verl's v1 worker takes a run's last
    # output for the run (its GRPO advantage, its reward function's and teacher's view)
    kept = max(samples, key=lambda line: (sum(line["loss_mask"]), -line["branch"]))
    other = samples[1 - samples.index(kept)]
    outputs = mapped["all"]
    assert [output["extra_fields"]["trajproxy"]["branch"] for output in outputs] == [other["branch"], kept["branch"]]
    for output in outputs:
        line = samples[output["extra_fields"]["trajproxy"]["branch"]]
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
    assert main["response_ids"] == kept["completion_ids"]
    assert main["extra_fields"]["trajproxy"]["untrained_lines"] == [
        {"branch": other["branch"], "turn_ids": other["turn_ids"], "sampled_ids": sum(other["loss_mask"])}
    ]

    # verl's length limits: the prompt cut from the left, the response from the right, and said
    for cut in got["cut"]:
        line = samples[cut["extra_fields"]["trajproxy"]["branch"]]
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
    # a loop that returns every line is refused where verl's classic worker (trainer.use_v1: false) would make it
    assert "branches: all returns several outputs per run, which only verl's v1 worker takes" in got["classic_all"]
    # the agent-loop file's `trajproxy` entry (its options) is not replaced by the loop's default when the module is
    # imported after the worker read the file
    assert got["reimported"] == 3


def restarting(folder: Path) -> Path:
    """The minimal agent's manifest (the same bundle) run twice in one episode, as an agent that restarts does: two
    calls, then one from the task again, which does not extend the episode's last call: two lines, branch 0 (two
    calls) and branch 1 (one)."""
    shutil.copytree(PRESETS / "minimal", folder / "minimal")
    run = "{bundle}/bin/python3 {bundle}/minimal/agent.py @{task_file} --workdir {workdir} --model {model}"
    manifest = (PRESETS / "minimal.toml").read_text()
    assert run in manifest
    (folder / "minimal.toml").write_text(manifest.replace(run, f"{run} --max-turns 2; {run} --max-turns 1"))
    return folder / "minimal.toml"


def test_verls_default_v1_worker_runs_the_loop_with_branches_main_and_all_and_its_replay_buffer_samples_them(
    vllm: Any, tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    """verl 0.9.1's default trainer (`trainer.use_v1: true`), as the GPU example configures it: verl's v1 trainer
    submits two rows (one per trajproxy entry of its agent-loop file: `branches: main`, `branches: all`), its
    `AgentLoopWorkerTQ` runs them through trajproxy's loop with verl's LLM server client and load balancer, and its
    replay buffer samples what the loop put in TransferQueue. Only verl's vLLM server replica (a GPU process) stands
    in, answering with the real vLLM on the CPU (tests/integrations/verl_v1_check.py says how and why). Each episode
    has two lines (the agent restarts)."""
    got = sandboxed("v1", vllm, tmp_path, restarting(tmp_path), label)
    assert got["use_v1"] is True and got["trainer_mode"] == "sync"  # the example keeps verl's default trainer
    # both rows' episodes ran to the agent's end (a sandbox that failed, or a row verl's worker marked failed, says why)
    # both rows' episodes ran to the restarted agent's end, its one-turn budget (a sandbox that failed to start, or a
    # row verl's worker marked failed, says why here)
    ended = "the agent exited with 1: [agent] stopped: no TASK_COMPLETE within 1 turns"
    assert [e["reason"] for e in got["episodes"]] == [ended] * 2, (got["episodes"], got["stderr"])
    episodes: dict[str, list[dict[str, Any]]] = {}
    for turn in got["turns"]:
        episodes.setdefault(turn["episode_id"], []).append(turn)
    assert len(episodes) == 2 and all([t["branch"] for t in turns] == [0, 0, 1] for turns in episodes.values())
    rows = got["rows"]
    outputs = {agent: [row for row in rows if row["agent_name"] == agent] for agent in ("trajproxy", "trajproxy_all")}
    main, every = outputs["trajproxy"], outputs["trajproxy_all"]
    # verl's keys: {uid}_{session}_{output}: one output for `main`, one per line for `all`, the main line last
    assert [row["key"].split("_", 1)[1] for row in main] == ["0_0"]
    assert [row["key"].split("_", 1)[1] for row in every] == ["0_0", "0_1"]
    assert [row["extra_fields"]["trajproxy"]["branch"] for row in (*main, *every)] == [0, 1, 0]

    seeds = {}
    for row in rows:
        info = row["extra_fields"]["trajproxy"]
        turns = episodes[info["episode_id"]]
        line = [turn for turn in turns if turn["branch"] == info["branch"]]
        calls = [{"prompt_ids": t["prompt_ids"], "token_ids": t["completion_ids"]} for t in line]
        # exactly the line's recorded ids, 1 in the mask on exactly the ids the engine sampled, its logprobs there
        assert row["prompts"] == line[0]["prompt_ids"]
        assert row["prompts"] + row["responses"] == line[-1]["prompt_ids"] + line[-1]["completion_ids"]
        assert row["response_mask"] == spans_of(calls, row["prompts"], row["responses"])
        served = {tuple(r["prompt_ids"] + r["token_ids"]): r for r in got["requests"]}
        sampled = [lp for t in line for lp in served[tuple(t["prompt_ids"] + t["completion_ids"])]["log_probs"]]
        trained = [lp for lp, m in zip(row["rollout_log_probs"], row["response_mask"], strict=True) if m]
        assert trained == pytest.approx(sampled)
        # the grader's reward on the last id (verl's rm_scores), none of verl's reward extras (which its v1 worker
        # copies from a run's last output to its others), verl's global steps as each turn's policy version
        assert row["rm_scores"][-1] == 0.0 and len(row["rm_scores"]) == len(row["responses"])
        assert row["extra_fields"]["reward_extra_info"] == {}
        assert info["policy_versions"] == ["7"] * len(line) and info["lines"] == 2
        seeds[info["episode_id"]] = 5 if row["agent_name"] == "trajproxy" else 6
    # `main`: the restarted line reported, untrained
    restarted = episodes[main[0]["extra_fields"]["trajproxy"]["episode_id"]][2]
    assert main[0]["extra_fields"]["trajproxy"]["untrained_lines"] == [
        {"branch": 1, "turn_ids": [restarted["id"]], "sampled_ids": len(restarted["completion_ids"])}
    ]
    # `all`: every id the episode sampled is trained, once
    all_turns = episodes[every[0]["extra_fields"]["trajproxy"]["episode_id"]]
    assert sum(sum(row["response_mask"]) for row in every) == sum(len(t["completion_ids"]) for t in all_turns)
    # verl's staleness tags read the loop's weights range; the prompt's own step is the trainer's
    for tag in got["tags"]:
        assert (tag["min_global_steps"], tag["max_global_steps"], tag["global_steps"]) == (7, 7, 3)

    # the worker ran its two rows (started at once) one episode at a time (max_episodes: 1), each call with its own
    # entry's sampling (seed), through verl's client and balancer to the one server
    requests = [(r["prompt_ids"], r["token_ids"], r["sampling_params"]["seed"]) for r in got["requests"]]
    runs = [
        [(t["prompt_ids"], t["completion_ids"], seeds[t["episode_id"]]) for t in turns] for turns in episodes.values()
    ]
    assert requests in (runs[0] + runs[1], runs[1] + runs[0])
    assert not engine.containers.list(all=True, filters={"label": label})
