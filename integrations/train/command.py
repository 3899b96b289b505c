"""`trajproxy train`: GRPO on one machine, through unmodified agents in sandboxes.

What runs: vLLM serves a copy of the model (`--out`/served); an embedded trajproxy records every episode in
`--out`/trajproxy.db; TRL's GRPO trainer takes the rollouts through `integrations.trl.TrlRollouts` (each episode an
agent in a Docker sandbox, its calls answered by vLLM in tokens mode, then graded) and takes an optimiser step on the
token-exact samples. After each step the new weights are written into the served folder and loaded by vLLM between
trajproxy's pause and its resume as policy version `step-K`, and the served logprobs of a sampled line are checked
against the trainer's (`--max-drift`). One line per step; a summary JSON, a reward-per-step PNG and a checkpoint
(`--out`/checkpoint) at the end. Ctrl-C or SIGTERM ends the episodes in flight (recorded cancelled), their sandboxes,
vLLM and trajproxy, and writes what was done so far.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from integrations.rollouts import Rollout, Rollouts, Served, tasks_of
from integrations.train.evaluate import evaluate, evaluation_line
from integrations.train.report import Step, Summary, plot, step_line, where_line
from integrations.train.vllm import SERVER_FLAGS, reload_weights, vllm_server
from integrations.train.weights import save_weights, served_copy, served_logprobs, trainer_logprobs
from integrations.trl import TrlRollouts, graded_reward
from proxy.settings import key_values
from sandbox.tasks.task import Task

SERVED_NAME = "policy"
# On a GPU, vLLM shares it with the trainer: a third of its memory for the engine
GPU_FLAGS = ("--gpu-memory-utilization", "0.3", "--enable-prefix-caching")


class Refused(Exception):
    """The command cannot run as asked: one line says why (exit status 2)."""


def main(args: argparse.Namespace) -> int:
    try:
        return train(args)
    except Refused as e:
        print(f"trajproxy train: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("trajproxy train: stopped; what was done is in the summary", file=sys.stderr)
        return 130


def train(args: argparse.Namespace) -> int:
    missing = [name for name in ("torch", "trl", "transformers", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        raise Refused(f"needs {', '.join(missing)}: pip install 'trajproxy[train]'")
    vllm_python = args.vllm_python or os.environ.get("TRAJPROXY_VLLM_PYTHON") or sys.executable
    if vllm_python == sys.executable and importlib.util.find_spec("vllm") is None:
        raise Refused("no vLLM in this Python: pass --vllm-python (a Python with vLLM) or set TRAJPROXY_VLLM_PYTHON")
    if args.steps < (0 if args.eval_tasks else 1) or args.group_size < 2 or args.tasks_per_step < 1:
        raise Refused(
            "--steps must be at least 1 (0 with --eval-tasks: evaluate only), --group-size at least 2 (GRPO "
            "compares a group), --tasks-per-step 1"
        )
    if args.eval_every < 0:
        raise Refused("--eval-every must be 0 (at the start and the end only) or more")
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise Refused(f"--model {args.model}: no config.json there (a model's folder is expected)")
    sampling = _sampling(args.sampling)
    labels = dict(label.partition("=")[::2] for label in args.label)
    if any(not key or not value for key, value in labels.items()):
        raise Refused("--label: KEY=VALUE is expected")
    try:
        tasks = {task.id: task for task in tasks_of(args.tasks)}
    except (OSError, ValueError) as e:
        raise Refused(f"{args.tasks}: {e}") from e
    if len(tasks) < args.tasks_per_step:
        raise Refused(f"{args.tasks} holds {len(tasks)} task(s), fewer than --tasks-per-step {args.tasks_per_step}")
    held_out: list[Task] = []
    if args.eval_tasks:
        try:
            held_out = list(tasks_of(args.eval_tasks))
        except (OSError, ValueError) as e:
            raise Refused(f"--eval-tasks {args.eval_tasks}: {e}") from e
        if not held_out:
            raise Refused(f"--eval-tasks {args.eval_tasks}: no task there")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = Summary(args, out)
    # SIGTERM stops the run as Ctrl-C does: everything started is ended on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        _train(args, model_dir, out, tasks, held_out, sampling, labels, vllm_python, summary)
    finally:
        written = Path(args.summary) if args.summary else out / "summary.json"
        summary.write(written)
        drawn = Path(args.plot) if args.plot else out / "reward.png"
        drew = bool(summary.steps or summary.evaluations)
        if drew:
            plot(summary, drawn)
        print(where_line(summary, written, drawn if drew else None), flush=True)  # the run's last line
    return 0 if summary.completed else 1


def _train(
    options: argparse.Namespace,
    model_dir: Path,
    out: Path,
    tasks: dict[str, Any],
    held_out: list[Task],
    sampling: dict[str, Any],
    labels: dict[str, str],
    vllm_python: str,
    summary: Summary,
) -> None:
    # vLLM runs here in a process of its own, from its own venv (vllm_server), never through TRL: TRL's warning that the
    # vLLM it finds installed is outside its tested range (five times, as TRL imports) is about a path not taken.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
    # lazy: the train extra's libraries (torch, TRL), which `train` checked are there before loading them
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental
    torch.manual_seed(options.seed)
    served = out / "served"
    served_copy(model_dir, served)  # vLLM reloads this folder in place; the trainer trains the same untied weights
    model = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(served)
    database = out / "trajproxy.db"
    database.unlink(missing_ok=True)
    flags = GPU_FLAGS if torch.cuda.is_available() else SERVER_FLAGS  # the CPU's: float32, eager, a small KV cache
    with vllm_server(
        served, vllm_python, served_name=SERVED_NAME, flags=flags, extra_args=options.vllm_arg, timeout=600
    ) as server:
        print(f"vLLM serves {model_dir} at {server.base_url}; episodes recorded in {database}", flush=True)

        def environment() -> Rollouts:
            return Rollouts(
                Served(server.base_url, SERVED_NAME),
                tokenizer=str(served),
                database_url=f"sqlite:///{database}",
                tool_parser=options.tool_parser,
                sampling=sampling,
                agent_timeout_s=options.agent_timeout_s,
                episode={"max_turns": options.max_turns} if options.max_turns else None,
                labels=labels,
            )

        began = time.monotonic()
        rollouts = TrlRollouts(
            environment, tasks, options.agent, concurrency=options.concurrency, run="train", seed=options.seed
        )

        def held_out_pass_rate(step: int) -> None:
            if held_out:
                evaluation = evaluate(rollouts, held_out, step, options.seed)
                summary.evaluations.append(evaluation)
                print(evaluation_line(evaluation), flush=True)

        try:
            version = "step-0"
            rollouts.call(rollouts.env.trainer.pause("hold"))
            rollouts.call(rollouts.env.trainer.resume(version))
            held_out_pass_rate(0)
            if options.steps == 0:
                summary.completed = True
                return
            began = time.monotonic()

            class Sync(TrainerCallback):  # type: ignore[misc]  # (transformers is not followed: pyproject.toml)
                def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                    nonlocal version, began
                    done = rollouts.rollouts[-options.group_size * options.tasks_per_step :]
                    version = f"step-{state.global_step}"
                    paused = rollouts.call(rollouts.env.trainer.pause("hold", drain_s=60))
                    if paused.in_flight:
                        raise RuntimeError(f"{paused.in_flight} call(s) still in flight after 60 s of draining")
                    probe = _probe(done)
                    before = served_logprobs(server, probe[0]) if probe else None
                    try:
                        save_weights(model, served)
                        reload_weights(server, version=version)
                    finally:
                        rollouts.call(rollouts.env.trainer.resume(version))
                    delta = moved = None
                    if probe and before:
                        after = served_logprobs(server, probe[0])
                        delta = _largest(after, trainer_logprobs(model, probe[0]), probe[1])
                        moved = _largest(after, before[1:], probe[1])
                    step = Step.of(state.global_step, done, rollouts.handed, delta, moved, time.monotonic() - began)
                    summary.steps.append(step)
                    print(step_line(step, options.steps), flush=True)
                    every = options.eval_every
                    if (every and state.global_step % every == 0) or state.global_step == options.steps:
                        held_out_pass_rate(state.global_step)
                    began = time.monotonic()
                    if delta is not None and delta > options.max_drift:
                        raise RuntimeError(
                            f"the served logprobs differ from the trainer's by {delta:.2g} nats after the sync "
                            f"(more than --max-drift {options.max_drift:g}): vLLM does not serve the trained weights"
                        )

            config = GRPOConfig(
                output_dir=str(out / "trl"),
                max_steps=options.steps,
                num_generations=options.group_size,
                per_device_train_batch_size=options.group_size * options.tasks_per_step,
                gradient_accumulation_steps=1,
                learning_rate=options.learning_rate,
                lr_scheduler_type="constant",  # every step's update at the rate asked for (TRL's default decays it)
                beta=0.0,
                temperature=float(sampling["temperature"]),  # TRL's logprobs at the temperature vLLM sampled at
                num_iterations=1,
                use_cpu=not torch.cuda.is_available(),
                bf16=False,
                seed=options.seed,
                logging_steps=1,
                report_to="none",
                save_strategy="no",
                disable_tqdm=True,
            )
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=graded_reward,
                args=config,
                train_dataset=datasets.Dataset.from_list(rollouts.dataset()),
                processing_class=tokenizer,
                rollout_func=rollouts,
                callbacks=[Sync()],
            )
            trainer.train()
            summary.completed = True
            checkpoint = out / "checkpoint"
            trainer.save_model(str(checkpoint))
            summary.checkpoint = str(checkpoint)
        finally:
            rollouts.close()


def _probe(done: list[Rollout]) -> tuple[list[int], int] | None:
    """A sampled line of the step's (its ids, where its completion starts), to check the sync on."""
    for rollout in done:
        for line in rollout.samples:
            if any(line["loss_mask"]) and not line["infrastructure_failure"]:
                return line["prompt_ids"] + line["completion_ids"], len(line["prompt_ids"])
    return None


def _largest(served: Sequence[float | None], other: Sequence[float | None], start: int) -> float:
    """max |served - other| over the completion's ids: `served` holds a None for the first id, `other` does not."""
    pairs = zip(served[start:], other[start - 1 :], strict=True)
    return max(abs(a - b) for a, b in pairs if a is not None and b is not None)


def _sampling(given: list[str]) -> dict[str, Any]:
    try:
        return {"temperature": 1.0, **key_values(given, "--sampling")}
    except ValueError as e:
        raise Refused(str(e)) from None


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt
