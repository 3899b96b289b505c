"""An RL run you can watch: GRPO on a tiny model served by a real vLLM, with an unmodified agent, through trajproxy.

    PY=$(bash .ci/vllm | tail -1)              # the vLLM venv's python (torch, transformers, vLLM, matplotlib)
    $PY examples/rl/grpo.py --steps 10 --group-size 8 --seed 0 --summary /tmp/grpo.json

What one step does:
  1. rollouts: for each task, `--group-size` episodes are created with the served policy `vllm:tiny` and their
     agents (examples/rl/agent.py, on the plain `openai` SDK, run with the project's .venv python) are run side by
     side. trajproxy sends each agent call to vLLM, with the sampling options given here (temperature 1, a regex
     that lets the answer be only one of the three colours), and records the token ids and logprobs it sampled;
  2. grading: the agent's printed answer earns 1.0 when it is the task's colour, else 0.0, posted as a reward;
  3. training: each episode's trajectory gives the prompt ids, the sampled ids and their logprobs exactly as
     recorded; GRPO's advantage is the reward normalised within its task's group; the loss is PPO's clipped
     objective against the recorded logprobs (plain REINFORCE with --clip 0), averaged over the sampled tokens;
     Adam takes `--epochs` steps on it;
  4. weight sync: trajproxy is paused (new agent calls held, turns in flight drained), the weights are pushed into
     the running vLLM, and trajproxy resumes with policy_version "step-K"; the next step checks that every reply
     it trains on carries that version, and that vLLM's logprobs match the trainer's model (max|Δlogp|).

Two things the trainer must match to stay on-policy, both checked by max|Δlogp| (it stops above --max-drift):
vLLM computes its logprobs after the regex's mask, so the trainer scores under the same constraint
(ChoiceConstraint); and vLLM 0.32's weight reload misses a tied output layer, so the served copy is untied
(integrations.train.weights.served_copy, as trajproxy train's). With an external vLLM (--vllm-url), serve an
untied model.

It starts vLLM (on a private, untied copy of the tiny model, which it overwrites) and `trajproxy serve` (SQLite in a
temporary folder) on free ports unless given --vllm-url/--model-dir and --trajproxy-url/--trainer-token, and stops
what it started on exit, Ctrl-C included. It prints one line per step, plots the mean reward per step (--plot,
grpo-reward.png in the working directory by default; `--plot docs/rl-reward.png` redraws the training guide's
figure) and writes a JSON summary (--summary).

The trajproxy it starts and the agents it runs come from the project's virtualenv (.venv: `python3 -m venv .venv &&
.venv/bin/pip install -e .`, which `bash .ci/run` also makes); without it, it says so in one line before it starts
anything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO)]
from rollouts import (  # noqa: E402
    COLOURS,
    SERVED_NAME,
    TASKS,
    TRAJPROXY,
    Rollout,
    Trajproxy,
    kill_agents,
    rollout,
    trajproxy_server,
)
from tiny_model import build as build_tiny_model  # noqa: E402
from weights import push_weights  # noqa: E402

from integrations.train.weights import served_copy  # noqa: E402
from testkit.vllm_server import vllm_server  # noqa: E402

# --- GRPO -------------------------------------------------------------------------------------------------------


def group_advantages(rollouts: list[Rollout]) -> None:
    """GRPO: each reward minus its task group's mean, over the group's standard deviation (0 where all agree)."""
    for task in {r.task for r in rollouts}:
        group = [r for r in rollouts if r.task == task]
        rewards = torch.tensor([r.reward for r in group])
        std = rewards.std() if len(group) > 1 else torch.tensor(0.0)
        for r, a in zip(group, (rewards - rewards.mean()) / (std + 1e-6), strict=True):
            r.advantage = float(a)


class ChoiceConstraint:
    """Which tokens the regex `(red|green|blue)` lets vLLM sample after a given prefix of sampled ids.

    vLLM applies a structured output's grammar mask to the logits before it computes the logprobs it returns, so
    the recorded logprobs are those of the constrained policy (a forced token has logprob 0). The trainer scores
    its sequences under the same constraint, else its ratio against the recorded logprobs is off by several nats.
    """

    def __init__(self, tokenizer: Any, choices: tuple[str, ...]) -> None:
        self.choices = choices
        self.eos = tokenizer.eos_token_id
        self.texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        self._allowed: dict[str, torch.Tensor] = {}

    def allowed(self, prefix_ids: list[int]) -> torch.Tensor:
        """A boolean row over the vocabulary: the ids that keep the text a prefix of a choice (or end it)."""
        prefix = "".join(self.texts[i] for i in prefix_ids)
        if prefix not in self._allowed:
            row = torch.tensor([bool(t) and any(c.startswith(prefix + t) for c in self.choices) for t in self.texts])
            row[self.eos] = prefix in self.choices
            self._allowed[prefix] = row
        return self._allowed[prefix]

    def mask(self, rollouts: list[Rollout], width: int) -> torch.Tensor:
        """[batch, width, vocab]: at the position that predicts sampled id k, the ids allowed there; all elsewhere."""
        allowed = torch.ones((len(rollouts), width, len(self.texts)), dtype=torch.bool)
        for i, r in enumerate(rollouts):
            p = len(r.prompt_ids)
            for k in range(len(r.completion_ids)):
                allowed[i, p + k - 1] = self.allowed(r.completion_ids[:k])
        return allowed


def batch(rollouts: list[Rollout], pad_id: int, constraint: ChoiceConstraint) -> dict[str, torch.Tensor]:
    """Prompt + sampled ids, right-padded; the mask is 1 on the sampled ids only, aligned with the recorded
    logprobs (placed at the positions of the ids they belong to)."""
    width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    ids = torch.full((len(rollouts), width), pad_id)
    attention = torch.zeros((len(rollouts), width), dtype=torch.long)
    mask = torch.zeros((len(rollouts), width))
    old = torch.zeros((len(rollouts), width))
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        ids[i, : p + c] = torch.tensor(r.prompt_ids + r.completion_ids)
        attention[i, : p + c] = 1
        mask[i, p : p + c] = 1
        old[i, p : p + c] = torch.tensor(r.logprobs)
    advantages = torch.tensor([r.advantage for r in rollouts])
    allowed = constraint.mask(rollouts, width)
    return {"ids": ids, "attention": attention, "mask": mask, "old": old, "advantages": advantages, "allowed": allowed}


def token_logprobs(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """log p(id_t | ids_<t), under the sampling constraint, at every position t >= 1 (position 0 gets 0)."""
    logits = model(input_ids=b["ids"], attention_mask=b["attention"]).logits
    logits = logits.masked_fill(~b["allowed"], float("-inf"))[:, :-1]
    picked = logits.log_softmax(-1).gather(-1, b["ids"][:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def grpo_loss(new: torch.Tensor, b: dict[str, torch.Tensor], clip: float) -> torch.Tensor:
    """PPO's clipped objective with GRPO's advantages, ratio against the recorded logprobs (REINFORCE when clip is
    0), a mean over each sequence's sampled tokens, then over sequences."""
    advantages = b["advantages"][:, None]
    if clip > 0:
        ratio = torch.exp(new - b["old"])
        objective = torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    else:
        objective = new * advantages
    per_sequence = (objective * b["mask"]).sum(1) / b["mask"].sum(1)
    return -per_sequence.mean()


# --- the run ----------------------------------------------------------------------------------------------------


def sync_weights(api: Trajproxy, model: torch.nn.Module, model_dir: Path, vllm_url: str, version: str) -> None:
    """pause (hold new agent calls, drain those in flight) -> push the weights into vLLM -> resume as `version`."""
    paused = api.call("POST", "/pause", {"mode": "hold", "drain_s": 60})
    if paused["in_flight"]:
        raise RuntimeError(f"trajproxy still had {paused['in_flight']} turns in flight after 60 s of draining")
    try:
        push_weights(model, model_dir, vllm_url, version=version)
    finally:
        resumed = api.call("POST", "/resume", {"policy_version": version})
    if resumed["policy_version"] != version:
        raise RuntimeError(f"trajproxy resumed as {resumed['policy_version']!r}, not {version!r}")


def plot(history: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    for t, task in enumerate(TASKS[: len(history[0]["task_reward"])]):
        ax.plot(steps, [h["task_reward"][t] for h in history], lw=1, alpha=0.45, label=f"target {task.target}")
    ax.plot(steps, [h["reward"] for h in history], "o-", color="black", lw=2, label="mean reward")
    ax.axhline(1 / len(COLOURS), color="grey", ls="--", lw=1, label="chance (1/3)")
    ax.set(xlabel="step", ylabel="mean reward", ylim=(-0.03, 1.03), title=title)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def train(args: argparse.Namespace, api: Trajproxy, vllm_url: str, model_dir: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    seeds = random.Random(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id or 0
    constraint = ChoiceConstraint(tokenizer, COLOURS)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    regex = "(" + "|".join(COLOURS) + ")"
    options = {
        "api_base": vllm_url,
        "temperature": 1.0,
        "max_tokens": args.max_tokens,
        "structured_outputs": {"regex": regex},
    }
    tasks = list(range(args.tasks))
    pool = ThreadPoolExecutor(max_workers=args.tasks * args.group_size)
    history: list[dict[str, Any]] = []
    version = "step-0"  # what the replies of a step must carry: the initial weights are step-0
    api.call("POST", "/resume", {"policy_version": version})  # not paused: this only names the version
    began = time.perf_counter()
    print("step  reward  rollouts  wall_s  tok/s  (rollout/train/sync s)  max|Δlogp|  loss      version", flush=True)
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            jobs = [
                pool.submit(rollout, api, t, seeds.randrange(2**31), options, args.agent_python)
                for t in tasks
                for _ in range(args.group_size)
            ]
            rollouts = [job.result() for job in jobs]
            t1 = time.perf_counter()
            stale = {r.policy_version for r in rollouts} - {version}
            if stale:
                raise RuntimeError(f"step {step}: replies carry policy_version {stale}, expected {version!r}")
            group_advantages(rollouts)
            b = batch(rollouts, pad_id, constraint)
            drift = 0.0
            for epoch in range(args.epochs):
                new = token_logprobs(model, b)
                if epoch == 0:  # vLLM sampled with the weights the trainer holds: their logprobs must agree
                    drift = float(((new.detach() - b["old"]).abs() * b["mask"]).max())
                    if drift > args.max_drift:
                        raise RuntimeError(
                            f"step {step}: vLLM's recorded logprobs differ from the trainer's by up to {drift:.3g} "
                            f"nats: the server does not sample from the weights the trainer holds"
                        )
                loss = grpo_loss(new, b, args.clip)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            t2 = time.perf_counter()
            version = f"step-{step + 1}"
            if step + 1 < args.steps:  # the last step's weights serve nothing here
                sync_weights(api, model, model_dir, vllm_url, version)
            t3 = time.perf_counter()
            tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
            sampled = sum(len(r.completion_ids) for r in rollouts)
            row = {
                "step": step,
                "reward": sum(r.reward for r in rollouts) / len(rollouts),
                "task_reward": [sum(r.reward for r in rollouts if r.task == t) / args.group_size for t in tasks],
                "rollouts": len(rollouts),
                "wall_s": t3 - t0,
                "rollout_s": t1 - t0,
                "train_s": t2 - t1,
                "sync_s": t3 - t2,
                "tokens": tokens,
                "sampled_tokens": sampled,
                "tokens_per_s": tokens / (t3 - t0),
                "max_logprob_drift": drift,
                "loss": loss.item(),
                "policy_version": rollouts[0].policy_version,
                "answers": {c: sum(r.answer == c for r in rollouts) for c in COLOURS},
            }
            history.append(row)
            print(
                f"{step:>4}  {row['reward']:6.3f}  {len(rollouts):>8}  {row['wall_s']:6.1f}  {row['tokens_per_s']:5.0f}"
                f"  ({row['rollout_s']:.1f}/{row['train_s']:.1f}/{row['sync_s']:.1f}){'':9}{drift:9.1e}"
                f"  {row['loss']:+.4f}   {row['policy_version']}",
                flush=True,
            )
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    wall = time.perf_counter() - began
    rollouts_total = sum(h["rollouts"] for h in history)
    return {
        "steps": len(history),
        "rollouts": rollouts_total,
        "wall_s": wall,
        "reward_first": history[0]["reward"],
        "reward_last": history[-1]["reward"],
        "tokens_per_s": sum(h["tokens"] for h in history) / wall,
        "sampled_tokens_per_s": sum(h["sampled_tokens"] for h in history) / wall,
        "rollouts_per_s": rollouts_total / wall,
        "config": {
            k: v if isinstance(v, int | float | str | None) else str(v)
            for k, v in vars(args).items()
            if k != "trainer_token"
        },
        "history": history,
    }


def missing_tools(args: argparse.Namespace) -> list[str]:
    """What the run needs from the project's .venv and does not find, checked before vLLM starts (a minute)."""
    needed = [Path(args.agent_python)] + ([] if args.trajproxy_url else [TRAJPROXY])
    return [str(path) for path in needed if not os.access(path, os.X_OK)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per task per step (GRPO's group)")
    parser.add_argument("--tasks", type=int, default=2, choices=range(1, len(TASKS) + 1), help="tasks per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--epochs", type=int, default=4, help="Adam steps per batch of rollouts")
    parser.add_argument("--clip", type=float, default=0.2, help="PPO clip range; 0: plain REINFORCE")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--max-drift", type=float, default=1e-3, help="stop when vLLM's logprobs differ from the trainer's by more"
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=Path("grpo-reward.png"),
        help="where to plot the mean reward per step (default: grpo-reward.png in the working directory; "
        "docs/rl-reward.png is the training guide's figure)",
    )
    parser.add_argument("--summary", type=Path, help="write a JSON summary here")
    parser.add_argument("--work-dir", type=Path, help="where the served copy of the model goes (default: a temp dir)")
    parser.add_argument("--vllm-url", help="a running vLLM (http://HOST:PORT/v1, dev mode) serving --model-dir")
    parser.add_argument("--model-dir", type=Path, help="with --vllm-url: the folder that server serves")
    parser.add_argument("--trajproxy-url", help="a running trajproxy (needs --trainer-token)")
    parser.add_argument("--trainer-token", default=os.environ.get("TRAJPROXY_TRAINER_TOKEN"))
    parser.add_argument("--agent-python", default=str(REPO / ".venv" / "bin" / "python"), help="has `openai`")
    args = parser.parse_args()
    if args.vllm_url and not args.model_dir:
        parser.error("--vllm-url needs --model-dir, the folder it serves (its weights are overwritten)")
    if args.trajproxy_url and not args.trainer_token:
        parser.error("--trajproxy-url needs --trainer-token (or TRAJPROXY_TRAINER_TOKEN)")
    if missing := missing_tools(args):
        sys.exit(
            f"grpo.py: {' and '.join(missing)} not found: make the project's virtualenv first (cd {REPO} && "
            "python3 -m venv .venv && .venv/bin/pip install -e .), or give --trajproxy-url and --agent-python"
        )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop what we started, as Ctrl-C does
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Loading weights", "Writing model shards" at every sync

    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="grpo-")))
        stack.callback(kill_agents)
        if args.vllm_url:
            vllm_url, model_dir = args.vllm_url, args.model_dir
        else:
            pristine = build_tiny_model(Path.home() / ".cache" / "trajproxy" / "grpo-tiny-model")
            model_dir = (args.work_dir or scratch) / "model"
            served_copy(pristine, model_dir)  # its weights are overwritten at every sync
            print(f"starting vLLM on {model_dir} ...", flush=True)
            server = stack.enter_context(vllm_server(model_dir, sys.executable, served_name=SERVED_NAME))
            vllm_url = server.base_url
        if args.trajproxy_url:
            url, token = args.trajproxy_url, args.trainer_token
        else:
            token = secrets.token_urlsafe(24)
            url = stack.enter_context(trajproxy_server(token, scratch))
        print(f"vLLM {vllm_url}, trajproxy {url}, ready after {time.perf_counter() - started:.0f} s", flush=True)
        api = Trajproxy(url, token)
        stack.callback(api.close)
        summary = train(args, api, vllm_url, Path(model_dir))
    summary["total_wall_s"] = time.perf_counter() - started
    title = f"GRPO, tiny model on vLLM via trajproxy ({summary['rollouts']} rollouts)"
    plot(summary["history"], args.plot, title)
    print(
        f"{summary['steps']} steps, {summary['rollouts']} rollouts in {summary['wall_s']:.0f} s of training "
        f"({summary['total_wall_s']:.0f} s in all); reward {summary['reward_first']:.3f} -> "
        f"{summary['reward_last']:.3f}; {summary['tokens_per_s']:.0f} tokens/s; plot {args.plot}",
        flush=True,
    )
    if args.summary:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # everything started is stopped by then (the ExitStack in main)
        print("interrupted; vLLM, trajproxy and the agents are stopped", file=sys.stderr)
        sys.exit(130)
