"""Held-out evaluation in `trajproxy train`: the pass rate of the served policy on tasks it does not train on.

Each evaluation runs every held-out task once through the same agent, sampling options and turn budget as training,
each task with a sampling seed of its own that is the same at every evaluation (the policy changes between them,
the draw does not). A task passes when its grade is 1.0; an episode whose infrastructure failed counts as not
passed, and is counted apart.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from integrations.trl import TrlRollouts
from sandbox.tasks.task import Task


@dataclass(frozen=True, slots=True)
class Evaluation:
    step: int  # the policy evaluated: step-K's weights (0: the model as given)
    pass_rate: float  # tasks passed / tasks run
    passed: int
    tasks: int
    failed: int  # episodes whose infrastructure failed (not passed)
    rewards: list[float | None]
    episodes: list[str | None]
    seconds: float


def evaluate(rollouts: TrlRollouts, tasks: Sequence[Task], step: int, seed: int) -> Evaluation:
    """Run each of `tasks` once under policy step-`step`; the seeds depend on `seed` and each task's place only."""
    began = time.monotonic()
    keys = [f"eval/step-{step}/{i}" for i in range(len(tasks))]
    seeds: list[int | None] = [(seed * 1_000_003 + 7_919 * (i + 1) + 104_729) % 2**31 for i in range(len(tasks))]
    done = rollouts.call(rollouts.run_all(tasks, keys, seeds))
    failed = [not r.samples or r.samples[0]["infrastructure_failure"] or r.reward is None for r in done]
    rewards = [None if bad else r.reward for r, bad in zip(done, failed, strict=True)]
    passed = sum(1 for reward in rewards if reward is not None and reward >= 1.0)
    return Evaluation(
        step,
        passed / len(tasks),
        passed,
        len(tasks),
        sum(1 for reward in rewards if reward is None),
        rewards,
        [r.episode_id for r in done],
        round(time.monotonic() - began, 2),
    )


def evaluation_line(evaluation: Evaluation) -> str:
    failed = f", {evaluation.failed} failed" if evaluation.failed else ""
    return (
        f"eval at step {evaluation.step}: passed {evaluation.passed}/{evaluation.tasks} held-out tasks "
        f"({evaluation.pass_rate:.0%}{failed})  {evaluation.seconds:.0f} s"
    )
