"""TRL's GRPO trainer, trained on agents in sandboxes: a `rollout_func` (TRL's hook for generation it does not do
itself) that runs each prompt's task as a graded trajproxy episode and hands TRL the token-exact result.

    rollouts = TrlRollouts(lambda: Rollouts(Served(vllm_url, "policy"), tokenizer=model_dir), tasks, "minimal")
    trainer = GRPOTrainer(model, reward_funcs=graded_reward, train_dataset=rollouts.dataset(), rollout_func=rollouts,
                          args=GRPOConfig(num_generations=G, ...))

The dataset's `prompt` column names a task (its id); TRL repeats each prompt `num_generations` times in a batch, and
each copy becomes one episode. What TRL gets per episode is its sample line (`proxy/storage/sample.schema.json`):
`prompt_ids`, `completion_ids` (the turns' sampled ids and the environment's ids between them), `logprobs`, and
`env_mask`, TRL's loss mask for multi-turn rollouts (1 on sampled ids, 0 on the environment's), with the grader's
reward as the extra field `graded_reward`, which `graded_reward` (the reward function) reads back.

TRL trains one sequence per episode. An episode of several branches (a sub-agent, a compaction) gives TRL its first
line, and the rest are counted in `dropped_lines`: their ids are not trained. An episode whose infrastructure failed
(a lost sandbox, an engine that aborted) or that sampled nothing gets a one-token completion with no loss and its
group's mean reward, so that it moves neither its group's baseline nor the model. Logprobs are the engine's; where a
line has none, each id's is None, which TRL (1.16) takes as unknown and corrects nothing by, never a made-up 0.0.

TRL calls `rollout_func` from its training loop, which is synchronous: the episodes run on an event loop of their
own, in a thread that lives as long as this object (`close`).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from integrations.rollouts import Rollout, Rollouts
from sandbox.tasks.task import Task

T = TypeVar("T")


class TrlRollouts:
    def __init__(
        self,
        rollouts: Callable[[], Rollouts],
        tasks: Mapping[str, Task],
        agent: str,
        *,
        concurrency: int = 4,
        run: str = "train",
        seed: int | None = None,
        on_rollout: Callable[[str, Rollout], None] = lambda _key, _rollout: None,
    ) -> None:
        """`rollouts`: makes the Rollouts the episodes run in (entered on this object's own loop); `tasks`: by id;
        `agent`: a preset's name or a manifest's path; `run`: the first part of every episode's key; `seed`: each
        episode's sampling seed is drawn from it, its step and its place in the batch (None: unseeded)."""
        self.tasks = dict(tasks)
        self._agent = agent
        self._concurrency = concurrency
        self._run = run
        self._seed = seed
        self._on_rollout = on_rollout
        self._running: set[asyncio.Task[Rollout]] = set()
        self.rollouts: list[Rollout] = []  # every rollout handed to TRL, in order
        self.handed: dict[str, list[Any]] | None = None  # what TRL was handed last (`to_trl`'s output)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="trajproxy-rollouts", daemon=True)
        self._thread.start()
        self.env: Rollouts = self.call(_enter(rollouts()))

    def dataset(self) -> list[dict[str, str]]:
        """TRL's train dataset: a row per task, its `prompt` the task's id (`datasets.Dataset.from_list` it)."""
        return [{"prompt": task_id} for task_id in self.tasks]

    def __call__(self, prompts: Sequence[Any], trainer: Any) -> dict[str, list[Any]]:
        """TRL's rollout_func: one graded episode per prompt (a task id), in the prompts' order."""
        step = int(getattr(getattr(trainer, "state", None), "global_step", 0))
        group_size = int(getattr(trainer, "num_generations", 1) or 1)
        keys = [f"{self._run}/step-{step}/{i}" for i in range(len(prompts))]
        seeds = [
            None if self._seed is None else (self._seed * 1_000_003 + step * 10_007 + i) % 2**31
            for i in range(len(keys))
        ]
        done = self.call(self.run_all([self.tasks[str(p)] for p in prompts], keys, seeds))
        self.rollouts.extend(done)
        self.handed = to_trl(done, group_size, eos=_eos(trainer))
        return self.handed

    async def run_all(self, tasks: Sequence[Task], keys: list[str], seeds: list[int | None]) -> list[Rollout]:
        """One graded episode per task (any task, the trainer's or held-out ones), `concurrency` at a time."""
        gate = asyncio.Semaphore(self._concurrency)

        async def one(task: Task, key: str, seed: int | None) -> Rollout:
            async with gate:
                sampling = {"seed": seed} if seed is not None else None
                rollout = await self.env.run(task, self._agent, key=key, sampling=sampling, metadata={"task": task.id})
            self._on_rollout(key, rollout)
            return rollout

        runs = [asyncio.create_task(one(*given)) for given in zip(tasks, keys, seeds, strict=True)]
        self._running.update(runs)
        try:
            return list(await asyncio.gather(*runs))
        finally:
            self._running.difference_update(runs)

    def close(self) -> None:
        """End the episodes' Rollouts (its trajproxy and sandboxes) and the loop's thread."""
        if self._thread.is_alive():
            try:
                self.call(self._cancel())  # episodes in flight (Ctrl-C): recorded cancelled, sandboxes removed
                self.call(self.env.__aexit__(None, None, None))
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)

    async def _cancel(self) -> None:
        running = list(self._running)
        for run in running:
            run.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the episodes' loop (e.g. `self.env.trainer.pause()`) and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()


async def _enter(rollouts: Rollouts) -> Rollouts:
    return await rollouts.__aenter__()


def _eos(trainer: Any) -> int:
    tokenizer = getattr(trainer, "processing_class", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    return int(eos) if isinstance(eos, int) else 0


def to_trl(rollouts: Sequence[Rollout], group_size: int, eos: int) -> dict[str, list[Any]]:
    """What TRL's rollout_func returns for these rollouts, in order (consecutive groups of `group_size`)."""
    lines = [_trainable_line(rollout) for rollout in rollouts]
    rewards: list[float] = []
    for start in range(0, len(rollouts), group_size):
        group = range(start, min(start + group_size, len(rollouts)))
        scored = [rollouts[i].reward or 0.0 for i in group if lines[i] is not None]
        mean = statistics.fmean(scored) if scored else 0.0
        rewards += [(rollouts[i].reward or 0.0) if lines[i] is not None else mean for i in group]
    out: dict[str, list[Any]] = {
        "prompt_ids": [],
        "completion_ids": [],
        "logprobs": [],
        "env_mask": [],
        "graded_reward": rewards,
        "episode_id": [r.episode_id for r in rollouts],
        "dropped_lines": [max(0, len(r.samples) - 1) for r in rollouts],
        "infrastructure_failure": [line is None for line in lines],
    }
    for rollout, line in zip(rollouts, lines, strict=True):
        if line is None:  # nothing to train: one token, masked
            first = rollout.samples[0]["prompt_ids"] if rollout.samples else [eos]
            out["prompt_ids"].append(first)
            out["completion_ids"].append([eos])
            out["logprobs"].append([None])
            out["env_mask"].append([0])
            continue
        out["prompt_ids"].append(line["prompt_ids"])
        out["completion_ids"].append(line["completion_ids"])
        # no logprobs recorded: None per id, which TRL reads as unknown (no importance correction), never as 0.0
        out["logprobs"].append(
            line["logprobs"] if line["logprobs"] is not None else [None] * len(line["completion_ids"])
        )
        out["env_mask"].append(line["loss_mask"])
    return out


def _trainable_line(rollout: Rollout) -> dict[str, Any] | None:
    """The line TRL trains for this rollout: its first, unless the episode is an infrastructure failure or no line
    has an id to train."""
    if not rollout.samples or rollout.samples[0]["infrastructure_failure"] or rollout.reward is None:
        return None
    line = rollout.samples[0]
    return line if any(line["loss_mask"]) else None


def graded_reward(completions: Sequence[Any], graded_reward: Sequence[float], **_: Any) -> list[float]:
    """TRL's reward function for these rollouts: the grader's reward each episode earned (`to_trl`'s extra field)."""
    return [float(value) for value in graded_reward]
