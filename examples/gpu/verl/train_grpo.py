"""A few GRPO steps of verl 0.9.1 on a real small model, its rollouts the `minimal` agent solving the calc example task
in Docker sandboxes through trajproxy's agent loop (integrations/verl.py). For a machine with a GPU; it does not run
on a CPU.

What it needs, on that machine:
- verl with its vLLM engine: `pip install 'verl[vllm]==0.9.1'` (torch 2.11 + CUDA, vLLM 0.24), and trajproxy's own
  dependencies: `pip install -e '.[served]'` from this checkout (or PYTHONPATH=<checkout>, as this script sets for
  verl's Ray workers);
- Docker, with the task's image built once: `docker build -t trajproxy/example-calc examples/tasks/calc`;
- a small instruct model in a local folder with a chat template that writes Hermes tool calls or plain text (the
  minimal agent reads a ```bash block from the reply), e.g. Qwen2.5-0.5B-Instruct or Qwen3-0.6B.

    python examples/gpu/verl/train_grpo.py --model /models/Qwen3-0.6B --out /tmp/verl-calc --steps 3
    python examples/gpu/verl/train_grpo.py --model /models/Qwen3-0.6B --out /tmp/verl-calc --check   # config only

It writes the dataset (rows naming the task and the agent: `agent_name` "trajproxy", `extra_info.tasks`,
`extra_info.task_id`, `extra_info.agent`) as parquet, verl's agent-loop file naming `TrajproxyAgentLoop`, and runs
`python -m verl.trainer.main_ppo` with GRPO over `--n` rollouts of each row. Every episode is recorded in
`OUT/episodes/rollouts-<pid>.db` (one SQLite file per agent-loop worker): `trajproxy export --shape tokens` reads it.
`--check` composes verl's config from its hydra defaults with the same overrides and prints the parts this script
sets, without a GPU: a key verl does not know fails there.

What runs is verl's default trainer, kept as it is: `trainer.use_v1: true` (verl's v1 `PPOTrainerSync`, trainer mode
`sync`), whose `AgentLoopWorkerTQ` runs each row's `--n` sessions at once and hands their outputs to the trainer
through TransferQueue. tests/test_integration_verl.py runs this script's overrides (at test size: one rollout per row,
a tiny model, one TransferQueue storage unit) through that trainer's submission, worker, LLM server client, load
balancer and replay buffer on a CPU, with the real vLLM on the CPU standing in for verl's GPU server replica; the
training steps themselves (actor, reference, weight sync) need the GPU and are not run there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TASKS = ROOT / "examples" / "tasks" / "calc" / "tasks.jsonl"


def write_inputs(out: Path, agent: str, rows: int) -> tuple[Path, Path]:
    """The dataset (the one calc task, `rows` times: GRPO samples each row --n times) and the agent-loop file."""
    import pandas as pd  # type: ignore[import-untyped]  # verl's own dependency

    sys.path.insert(0, str(ROOT))
    from integrations.rollouts import find_task

    task = find_task(TASKS)
    records = [
        {
            "data_source": "trajproxy/calc",
            "prompt": [{"role": "user", "content": task.prompt}],  # verl's raw_prompt; the agent writes its own
            "agent_name": "trajproxy",
            "reward_model": {"style": "rule", "ground_truth": ""},  # the grader's reward comes with the rollout
            "extra_info": {"index": i, "tasks": str(TASKS), "task_id": task.id, "agent": agent},
        }
        for i in range(rows)
    ]
    out.mkdir(parents=True, exist_ok=True)
    data = out / "calc.parquet"
    pd.DataFrame(records).to_parquet(data)
    loops = out / "agent_loops.yaml"
    entry = {
        "name": "trajproxy",
        "_target_": "integrations.verl.TrajproxyAgentLoop",
        "database_dir": str(out / "episodes"),
        "branches": "main",  # "all": every line of a branching episode, the main line last (v1 worker only)
        "tool_parser": "hermes",
        "sampling": {"max_tokens": 512},  # each call's cap; verl's response_length caps the whole episode
        "turn_timeout_s": 600,
        "agent_timeout_s": 600,
    }
    loops.write_text(json.dumps([entry]))  # JSON is YAML
    return data, loops


def overrides(model: str, data: Path, loops: Path, out: Path, steps: int, n: int, rows: int) -> list[str]:
    """verl's PPO trainer config, as command-line overrides: GRPO, one GPU, vLLM, trajproxy's agent loop."""
    prompt_length, response_length = 4096, 4096  # a multi-turn agent's first prompt, then all its turns
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"data.train_batch_size={rows}",
        f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={response_length}",
        "data.filter_overlong_prompts=false",
        "data.return_raw_chat=true",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={rows}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
        f"actor_rollout_ref.rollout.max_model_len={prompt_length + response_length}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=trajproxy",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console]",
        "trainer.project_name=trajproxy",
        "trainer.experiment_name=calc-grpo",
        f"trainer.default_local_dir={out / 'checkpoints'}",
    ]


def check(settings: list[str]) -> None:
    """Compose verl's config with the overrides (no GPU, no Ray): an unknown key or a bad value fails here."""
    import verl
    from hydra import compose, initialize_config_dir  # type: ignore[import-not-found]
    from omegaconf import OmegaConf  # type: ignore[import-not-found]
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    folder = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=folder, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=settings)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    rollout = config.actor_rollout_ref.rollout
    shown = {
        "adv_estimator": config.algorithm.adv_estimator,
        "rollout": {k: rollout[k] for k in ("name", "mode", "n", "prompt_length", "response_length", "max_model_len")},
        "agent": OmegaConf.to_container(rollout.agent, resolve=True),
        "use_v1": config.trainer.use_v1,
        "trainer_mode": config.trainer.v1.trainer_mode,
    }
    print(json.dumps(shown, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local folder holding the model and its tokenizer")
    parser.add_argument("--out", type=Path, required=True, help="the dataset, the episodes' databases, checkpoints")
    parser.add_argument("--agent", default="minimal", help="a preset or a manifest's path")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--n", type=int, default=4, help="rollouts per row (GRPO's group)")
    parser.add_argument("--rows", type=int, default=2, help="rows per step")
    parser.add_argument("--check", action="store_true", help="only compose and show verl's config")
    args = parser.parse_args()
    data, loops = write_inputs(args.out.resolve(), args.agent, args.rows)
    settings = overrides(args.model, data, loops, args.out.resolve(), args.steps, args.n, args.rows)
    if args.check:
        check(settings)
        return
    # verl's Ray workers import the agent loop by its name: they need this checkout on their path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *settings], env=env, check=True)


if __name__ == "__main__":
    main()
