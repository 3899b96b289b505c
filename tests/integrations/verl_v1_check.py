"""Runs inside verl's environment (.ci/trainer-venv verl), for tests/test_integration_verl.py: trajproxy's agent loop
in verl 0.9.1's default trainer path (`trainer.use_v1: true`, trainer mode `sync`), on the CPU, with the GPU example's
config (examples/gpu/verl/train_grpo.py) at test size. Prints one JSON object (its last line of stdout): what verl's
replay buffer sampled out of TransferQueue, what the engine sampled, what trajproxy recorded.

verl's own, as its v1 trainer runs them: a local Ray, TransferQueue from verl's `transfer_queue` config (one storage
unit where verl starts eight: its capacity, not its behaviour), the trainer's dataset, batch and submission
(`PPOTrainerSync._add_batch_to_generate`: the prompts' tags put in TransferQueue, then
`AgentLoopManagerTQ.generate_sequences`), its agent-loop manager and worker (one `AgentLoopWorkerTQ` Ray actor, which
makes the loops from verl's agent-loop file and puts their outputs in TransferQueue), verl's `LLMServerClient` and
its global load balancer (`GlobalRequestLoadBalancer`, a Ray actor), and the sync replay buffer's `sample`.

What stands in: verl's vLLM server replica. verl's is `vLLMHttpServer`, a Ray actor running vLLM's AsyncLLM on the
trainer's GPUs, woken and given weights by the trainer's workers; none of that runs on a CPU. The stand-in is a Ray
actor with the same `generate` call, registered with verl's load balancer as a replica is: it builds
`vllm.SamplingParams(**…)` from each call's options as verl's server does (an unknown name raises), samples with the
real vLLM on the CPU over HTTP, and answers verl's `TokenOutput` with the weights' `global_steps`.

    python verl_v1_check.py ARGS_JSON
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pandas as pd  # type: ignore[import-untyped]
import ray
import transfer_queue as tq  # type: ignore[import-not-found]
from omegaconf import OmegaConf, open_dict  # type: ignore[import-not-found]
from verl.trainer.constants_ppo import get_ppo_ray_runtime_env
from verl.trainer.ppo.v1 import AgentLoopManagerTQ, PPOTrainerSync
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.router import get_router_handle

from examples.gpu.verl.train_grpo import overrides
from integrations.rollouts import find_task
from testkit.databases import recorded_episodes, recorded_turns
from tests.integrations.verl_check import GLOBAL_STEPS, PROMPT_LENGTH, RESPONSE_LENGTH, loops_yaml, serve, verl_config
from tests.vllm_generate import VllmGenerate

AGENT_NAMES = ("trajproxy", "trajproxy_all")  # the loop entries (branches main and all), a row each
STEP = 3  # the trainer's global step at which the prompts are sampled (its weights are GLOBAL_STEPS's)


class VllmServer:
    """The stand-in for verl's vLLM server replica (see the module's docstring); every call is kept."""

    def __init__(self, base_url: str, model: str) -> None:
        self.engine = VllmGenerate(base_url, model)
        self.requests: list[dict[str, Any]] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **media: Any
    ) -> TokenOutput:
        output, request = await serve(self.engine, request_id, prompt_ids, sampling_params, GLOBAL_STEPS)
        self.requests.append(request)
        return output

    def calls(self) -> list[dict[str, Any]]:
        return self.requests


def dataset(folder: Path, tasks: str, agent: str) -> Path:
    """Two rows of the example task, one per loop entry of verl's agent-loop file (each row's `agent_name`)."""
    task = find_task(tasks)
    records = [
        {
            "data_source": "trajproxy/calc",
            "prompt": [{"role": "user", "content": task.prompt}],
            "agent_name": name,
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {"index": i, "tasks": tasks, "task_id": task.id, "agent": agent},
        }
        for i, name in enumerate(AGENT_NAMES)
    ]
    path = folder / "rows.parquet"
    pd.DataFrame(records).to_parquet(path)
    return path


def config_of(args: dict[str, Any], folder: Path, data: Path) -> Any:
    """The GPU example's verl config (its overrides), at test size: one rollout per row, the test's model, lengths
    and agent-loop file (two trajproxy entries: `branches` main and all, each with its own sampling seed)."""
    common = {
        "database_dir": str(folder / "db"),
        "labels": args["labels"],
        "max_episodes": 1,  # the worker's two rows (both started at once by the v1 worker) run one at a time
    }
    sampling = {"max_tokens": 160, "structured_outputs": {"regex": args["regex"]}}
    entries = {
        "trajproxy": {**common, "sampling": {**sampling, "seed": 5}},
        "trajproxy_all": {**common, "branches": "all", "sampling": {**sampling, "seed": 6}},
    }
    loops = loops_yaml(folder, entries)
    example = overrides(args["model_dir"], data, loops, folder / "out", steps=1, n=1, rows=2)
    test_size = [
        f"data.max_prompt_length={PROMPT_LENGTH}",
        f"data.max_response_length={RESPONSE_LENGTH}",
        f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
        f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "data.dataloader_num_workers=0",  # verl's 8 loader processes, for two rows
    ]
    config = verl_config(args["model_dir"], loops, *example, *test_size)
    with open_dict(config):
        config.transfer_queue.enable = True  # as verl's TaskRunnerV1 sets it
    OmegaConf.resolve(config)
    return config


def fetched(keys: list[str]) -> list[dict[str, Any]]:
    """What verl's trainer reads back of each sampled key from TransferQueue."""
    names = ["uid", "session_id", "prompts", "responses", "response_mask", "rollout_log_probs", "rm_scores"]
    data = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=[*names, "extra_fields", "extra_info"])
    rows: list[dict[str, Any]] = [{"key": key} for key in keys]
    for name in names:
        values = data[name]
        listed = [v.tolist() for v in values.unbind(0)] if hasattr(values, "unbind") else list(values)
        for row, value in zip(rows, listed, strict=True):
            row[name] = value
    for name in ("extra_fields", "extra_info"):
        for row, value in zip(rows, list(data[name]), strict=True):
            row[name] = getattr(value, "data", value)
    for row in rows:  # the row's loop entry (verl's worker takes `agent_name` out of what it stores)
        row["agent_name"] = AGENT_NAMES[row["extra_info"]["index"]]
    return rows


def v1_check(args: dict[str, Any]) -> dict[str, Any]:
    """verl's v1 trainer as TaskRunnerV1 runs it (synchronously: verl's `auto_await` calls wait where no event loop
    runs), up to the batch its replay buffer samples."""
    folder = Path(args["folder"])
    config = config_of(args, folder, dataset(folder, args["tasks"], args["agent"]))
    runtime_env = get_ppo_ray_runtime_env(config)
    runtime_env.setdefault("env_vars", {})["TRANSFER_QUEUE_ENABLE"] = "1"  # as verl's run_ppo adds it
    # a cluster of its own: with no address Ray joins the last one started on this machine (another test's)
    ray.init(address="local", num_cpus=8, include_dashboard=False, runtime_env=runtime_env)
    try:
        tq.init(config.transfer_queue)
        server = ray.remote(VllmServer).remote(args["base_url"], args["model"])  # a Ray actor, as a replica's server
        balancer = get_router_handle(servers={"vllm-cpu:0": server})  # as LLMServerManager makes it
        client = LLMServerClient(config=config, load_balancer_handle=balancer)  # the sync trainer's client
        trainer = PPOTrainerSync(config=config)  # only its dataset, submission and replay buffer are used
        trainer._init_tokenizer()
        trainer._init_dataloader()
        trainer.global_steps = STEP
        trainer.agent_loop_manager = AgentLoopManagerTQ.create(config=config, llm_client=client)
        trainer._add_batch_to_generate()
        batch, _ = trainer.replay_buffer.sample(STEP, "train", 2)
        rows = fetched(list(batch.keys))
        requests = ray.get(server.calls.remote())
    finally:
        tq.close()
        ray.shutdown()
    (database,) = (folder / "db").glob("rollouts-*.db")
    turns = recorded_turns(f"sqlite:///{database}")
    return {
        "episodes": recorded_episodes(f"sqlite:///{database}"),
        "use_v1": config.trainer.use_v1,
        "trainer_mode": config.trainer.v1.trainer_mode,
        "rows": rows,
        "tags": list(batch.tags),
        "requests": requests,
        "turns": [
            {
                "id": turn.id,
                "episode_id": turn.episode_id,
                "branch": turn.branch,
                "prompt_ids": list(turn.reply.prompt_token_ids or []) if turn.reply else None,
                "completion_ids": list(turn.reply.completion_token_ids or []) if turn.reply else None,
            }
            for turn in turns
        ],
    }


def main() -> None:
    result = v1_check(json.loads(sys.argv[1]))
    sys.stdout.flush()
    print(json.dumps(result, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)))
    os._exit(0)  # Ray's and TransferQueue's threads are not the check's to wait for


if __name__ == "__main__":
    main()
