"""What `trajproxy train` reports: a line per step, the summary JSON and the reward-per-step plot."""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from integrations.rollouts import Rollout
from integrations.train.evaluate import Evaluation


@dataclass(frozen=True, slots=True)
class Step:
    step: int
    mean_reward: float | None  # over the step's scored episodes
    rewards: list[float | None]  # each episode's, None for an infrastructure failure
    episodes: list[str | None]
    turns: int  # calls answered in the step's episodes
    trained_ids: int  # sampled ids with loss, over the lines TRL trained
    environment_ids: int  # ids TRL was handed at no loss between calls: the environment's (tool output, template)
    policy_versions: dict[str, int]  # the version each turn was answered with, counted
    drift: float | None  # max |served - trainer| logprob on a sampled line after the sync (nats)
    moved: float | None  # max |served after - served before| logprob on that line: the sync changed the policy
    seconds: float

    @classmethod
    def of(
        cls,
        step: int,
        done: list[Rollout],
        handed: dict[str, list[Any]] | None,
        drift: float | None,
        moved: float | None,
        seconds: float,
    ) -> Step:
        """The step's episodes, and what TRL was handed for them (`to_trl`'s output; None: nothing)."""
        failed = [not r.samples or r.samples[0]["infrastructure_failure"] or r.reward is None for r in done]
        rewards = [None if bad else r.reward for r, bad in zip(done, failed, strict=True)]
        scored = [reward for reward in rewards if reward is not None]
        versions: Counter[str] = Counter()
        turns = 0
        for rollout in done:
            for line in rollout.samples:
                turns += len(line["turns"])
                versions.update(str(version) for version in line["policy_versions"])
        given = handed or {"env_mask": [], "infrastructure_failure": []}
        pairs = zip(given["env_mask"], given["infrastructure_failure"], strict=True)
        masks = [mask for mask, failure in pairs if not failure]
        trained = sum(sum(mask) for mask in masks)
        return cls(
            step,
            statistics.fmean(scored) if scored else None,
            rewards,
            [r.episode_id for r in done],
            turns,
            trained,
            sum(len(mask) for mask in masks) - trained,
            dict(versions),
            drift,
            moved,
            round(seconds, 2),
        )


@dataclass
class Summary:
    args: argparse.Namespace
    out: Path
    steps: list[Step] = field(default_factory=list)
    evaluations: list[Evaluation] = field(default_factory=list)
    completed: bool = False
    checkpoint: str | None = None

    def write(self, path: Path) -> None:
        given = {k: v for k, v in vars(self.args).items() if k != "handler"}
        body: dict[str, Any] = {
            "completed": self.completed,
            "arguments": given,
            "database": str(self.out / "trajproxy.db"),
            "checkpoint": self.checkpoint,
            "steps": [asdict(step) for step in self.steps],
            "evaluations": [asdict(evaluation) for evaluation in self.evaluations],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(body, indent=2) + "\n")


def step_line(step: Step, steps: int) -> str:
    reward = "n/a" if step.mean_reward is None else f"{step.mean_reward:.2f}"
    drift = "n/a" if step.drift is None else f"{step.drift:.1e}"
    moved = "n/a" if step.moved is None else f"{step.moved:.2g}"
    versions = ", ".join(f"{v} x{n}" for v, n in sorted(step.policy_versions.items()))
    return (
        f"step {step.step}/{steps}  reward {reward}  episodes {len(step.rewards)}  turns {step.turns}  "
        f"trained ids {step.trained_ids} (environment's {step.environment_ids})  versions [{versions}]  "
        f"logprobs moved {moved}, drift {drift}  "
        f"{step.seconds:.0f} s"
    )


def where_line(summary: Summary, written: Path, drawn: Path | None) -> str:
    """The run's last line: where its summary, plot, checkpoint and episodes are."""
    checkpoint = summary.checkpoint or "none (the run did not complete)"
    return (
        f"trajproxy train: summary {written}, plot {drawn or 'none (no step done)'}, checkpoint {checkpoint}, "
        f"episodes {summary.out / 'trajproxy.db'}"
    )


def plot(summary: Summary, path: Path) -> None:
    """The mean reward per step, each episode's reward as a dot."""
    import matplotlib  # lazy: the train extra's; only a run that plots loads it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as above, once the backend is chosen

    figure, axes = plt.subplots(figsize=(6, 3.5))
    for step in summary.steps:
        scored = [r for r in step.rewards if r is not None]
        axes.scatter([step.step] * len(scored), scored, s=12, alpha=0.3, color="tab:blue")
    points = [(s.step, s.mean_reward) for s in summary.steps if s.mean_reward is not None]
    axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", color="tab:blue", label="mean reward")
    if summary.evaluations:
        evaluated = [(e.step, e.pass_rate) for e in summary.evaluations]
        axes.plot(
            [p[0] for p in evaluated],
            [p[1] for p in evaluated],
            marker="s",
            color="tab:orange",
            label=f"held-out pass rate ({summary.evaluations[0].tasks} tasks)",
        )
    axes.set_xlabel("step (the policy that sampled: step-(K-1))")
    axes.set_ylabel("reward")
    axes.set_ylim(-0.05, 1.05)
    axes.set_title(f"trajproxy train: {summary.args.agent} on {Path(summary.args.tasks).name}")
    axes.legend(loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
