"""The command line of `trajproxy train` (its options); what it does is `integrations.train.command`, loaded only
when it runs, with TRL, torch and vLLM."""

from __future__ import annotations

import argparse

TRAIN = "integrations.train.command:main"


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    train = commands.add_parser(
        "train",
        help="train a model on tasks through an agent in sandboxes (GRPO with TRL, the model served by vLLM)",
        description="Train a model with GRPO on tasks, each episode an unmodified agent in a Docker sandbox whose "
        "calls the model answers through trajproxy, served by vLLM in tokens mode, then graded. TRL's GRPO trainer "
        "trains on the token-exact samples; after each step the new weights are loaded into vLLM (trajproxy paused, "
        "then resumed as policy version step-K). Needs the train extra (pip install 'trajproxy[train]') and a "
        "Python with vLLM (--vllm-python). Writes a summary JSON, a reward-per-step plot and a checkpoint.",
    )
    train.add_argument("tasks", help="the tasks: any path `trajproxy run` takes (JSONL, Harbor directories, ...)")
    train.add_argument("--agent", required=True, help="the agent: a preset's name or a manifest's path")
    train.add_argument("--model", required=True, help="the model's folder (weights, config, tokenizer)")
    train.add_argument("--steps", type=int, default=10, help="training steps (default: 10)")
    train.add_argument("--group-size", type=int, default=4, help="episodes per task per step, GRPO's group (4)")
    train.add_argument("--tasks-per-step", type=int, default=1, help="tasks in each step's batch (default: 1)")
    train.add_argument("--learning-rate", type=float, default=1e-3, help="Adam's learning rate (default: 1e-3)")
    train.add_argument("--seed", type=int, default=0, help="the trainer's and the sampling's seed (default: 0)")
    train.add_argument("--concurrency", type=int, default=4, help="episodes at once (default: 4)")
    train.add_argument(
        "--sampling",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a sampling option for every call, as vLLM names it (JSON values: temperature=1.0, max_tokens=256, "
        'structured_outputs={"regex": "..."}); repeatable',
    )
    train.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE", help="a Docker label on every sandbox (repeatable)"
    )
    train.add_argument("--tool-parser", default="hermes", help="the model family's tool-call parser (hermes)")
    train.add_argument(
        "--max-turns",
        type=int,
        help="each episode's calls at most: the next one is refused (429 budget_exceeded), the agent stops, and the "
        "episode is graded and finished as truncated (its reason says so), not failed",
    )
    train.add_argument(
        "--eval-tasks",
        help="held-out tasks (any path `trajproxy run` takes): each run once, with a fixed seed of its own, at the "
        "start and the end and every --eval-every steps; the pass rate goes to the summary and the plot",
    )
    train.add_argument(
        "--eval-every", type=int, default=0, help="evaluate on --eval-tasks every N steps (default: 0, start and end)"
    )
    train.add_argument("--agent-timeout-s", type=float, help="each agent's budget (default: the task's)")
    train.add_argument(
        "--out", default="trajproxy-train", help="the run's folder: served weights, database, checkpoint"
    )
    train.add_argument("--summary", help="the summary JSON (default: OUT/summary.json)")
    train.add_argument("--plot", help="the reward-per-step plot, a PNG (default: OUT/reward.png)")
    train.add_argument(
        "--vllm-python",
        help="a Python with vLLM, which serves the model (default: $TRAJPROXY_VLLM_PYTHON, else this Python)",
    )
    train.add_argument(
        "--vllm-arg", action="append", default=[], help="an extra argument for vLLM's server (repeatable)"
    )
    train.add_argument(
        "--max-drift",
        type=float,
        default=1e-3,
        help="stop when the served logprobs differ from the trainer's by more than this after a sync (nats)",
    )
    train.set_defaults(handler=TRAIN)
