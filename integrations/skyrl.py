"""SkyRL's generator for unmodified agents in sandboxes: each trajectory of a batch is one graded episode of an agent on
a task, every call the agent makes answered by SkyRL's own inference engine client, and the episode's recorded ids
handed back as SkyRL's `GeneratorOutput`.

    generator = TrajproxyGenerator(inference_engine_client, tokenizer="/models/qwen3-0.6b", agent="mini-swe-agent")
    output = await generator.generate(generator_input)      # SkyRL's trainer calls this every step

What a batch's rows say (`env_extras`, the dataset's columns besides `prompt` and `env_class`):
    tasks     a path `trajproxy run` takes (a JSONL file, a Harbor task folder, a folder of them): required
    task_id   which task in it (needed when it holds several)
    agent     the agent for this row (a preset's name or a manifest's path; default: the generator's)
The row's `prompt` is not sent anywhere: the agent reads the task's own instruction, as it would outside training.

Each turn's prompt ids are built by trajproxy (the chat template, the continuation of the agent's previous call, tool
parsing) and sampled by `InferenceEngineClient.generate` with the trajectory's episode key as its session id (sticky
routing) and a prefix-cache salt of the weights' version; the ids and logprobs it returns are what is recorded and
trained. An episode's key is `<run>-<phase>-step<global step>-<instance id>_<repetition>`: SkyRL's trajectory ids
repeat from step to step, the keys do not. The salt is SkyRL's own (`build_vllm_cache_salt`), so trajproxy's calls and
SkyRL's generators share the engine's prefix cache for one policy version.

Written for SkyRL 0.4 (Python 3.12). SkyRL's options this generator cannot serve are refused when it is made: routed
experts (R3) and sampler support sets, per-token side channels trajproxy does not record (a sample line holds ids,
mask and logprobs), which SkyRL would otherwise train without.

How sample lines become rows: integrations/skyrl_outputs.py (`generator_output`, a plain function).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from integrations.rollouts import Generated, Rollout, Rollouts, find_task
from integrations.skyrl_outputs import generator_output
from integrations.token_server import ResponseBudget
from sandbox.tasks.task import Task

EXTRA_TASKS, EXTRA_TASK_ID, EXTRA_AGENT = "tasks", "task_id", "agent"
# SkyRL's sampling parameters that only shape the text it would decode, not what is sampled
_NOT_SAMPLING = frozenset({"logprobs", "skip_special_tokens", "n"})
# SkyRL's inference options whose per-token side channels this generator does not return (the client's fields)
_REFUSED = {
    "enable_return_routed_experts": "routed experts (R3)",
    "enable_return_sample_support_set": "sampler support sets",
}


def _import_skyrl() -> Any:
    """SkyRL's generator base class, or None where SkyRL is not installed (the mapping needs none of it)."""
    try:
        from skyrl.train.generators.base import GeneratorInterface  # lazy: the skyrl extra
    except ImportError:
        return None
    return GeneratorInterface


_GeneratorInterface = _import_skyrl()
if TYPE_CHECKING:
    _Base = object
else:
    _Base = _GeneratorInterface or object


def episode_sampling(sampling_params: dict[str, Any] | None) -> dict[str, Any]:
    """A batch's sampling parameters (vLLM's names, as SkyRL's `get_sampling_params_for_backend` gives them) as an
    episode's sampling options: unset ones and those that only shape decoded text left out."""
    return {k: v for k, v in (sampling_params or {}).items() if v is not None and k not in _NOT_SAMPLING}


class TrajproxyGenerator(_Base):  # SkyRL's GeneratorInterface
    """SkyRL's `GeneratorInterface`: `generate` runs each trajectory of a batch as a sandboxed, graded episode whose
    calls `inference_engine_client` answers, and maps the episodes' sample lines to a `GeneratorOutput`.

    The embedded trajproxy, its token server and the Docker sandboxes start at the first batch, on the trainer's
    event loop, and serve every later one; `aclose` ends them. Episodes are recorded in `database_url` (default: a
    SQLite file in a temporary folder that `aclose` removes: give one to keep them)."""

    def __init__(
        self,
        inference_engine_client: Any,
        *,
        tokenizer: str,
        agent: str = "minimal",
        run_name: str = "skyrl",
        model: str | None = None,
        step_wise: bool = False,
        mask_failed_groups: bool = True,
        overlong_filtering: bool = False,
        use_cache_salt: bool = True,
        max_concurrency: int | None = None,
        database_url: str | None = None,
        tool_parser: str = "hermes",
        chat_template_kwargs: dict[str, Any] | None = None,
        turn_timeout_s: float = 600.0,
        agent_timeout_s: float | None = None,
        max_total_length: int | None = None,
    ) -> None:
        """`inference_engine_client`: SkyRL's (`InferenceEngineInterface`, e.g. `RemoteInferenceClient`);
        `tokenizer`: the policy's folder (its chat template); `agent`: the rows' agent unless a row names one;
        `model`: the engine's model or LoRA adapter to sample (default: the client's); `step_wise`,
        `overlong_filtering`: SkyRL's `generator.step_wise_trajectories` and `generator.apply_overlong_filtering`;
        `use_cache_salt`: salt the engine's prefix cache with the weights' version, as SkyRL's generators do (their
        salt);
        `max_total_length`: an episode's ids, its first prompt and all that follows, at most this many (each call's
        `max_tokens` held to what is left, at least 1), as SkyRL's `generator.max_input_length` bounds its own."""
        if _GeneratorInterface is None:
            raise ImportError("TrajproxyGenerator needs SkyRL 0.4: pip install 'skyrl>=0.4'")
        for option, what in _REFUSED.items():
            if getattr(inference_engine_client, option, False):
                raise ValueError(f"TrajproxyGenerator returns no {what}: set generator.inference_engine.{option}=false")
        self._client = inference_engine_client
        self._model = model
        self._agent = agent
        self._run_name = run_name
        self._step_wise = step_wise
        self._mask_failed_groups = mask_failed_groups
        self._overlong_filtering = overlong_filtering
        self._use_cache_salt = use_cache_salt
        self._limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self._max_total_length = max_total_length
        self._budgets: dict[str, ResponseBudget] = {}
        self._llm_seconds: dict[str, float] = {}
        self._rollouts_options: dict[str, Any] = {
            "tokenizer": tokenizer,
            "database_url": database_url,
            "tool_parser": tool_parser,
            "chat_template_kwargs": chat_template_kwargs,
            "turn_timeout_s": turn_timeout_s,
            "agent_timeout_s": agent_timeout_s,
        }
        self._rollouts: Rollouts | None = None
        self._opening = asyncio.Lock()
        self._tasks: dict[tuple[str, str | None], Task] = {}
        self._salt: str | None = None
        self._batches = 0

    async def generate(self, input_batch: Any) -> Any:
        """SkyRL's `generate(GeneratorInput) -> GeneratorOutput`, in the order of the input's trajectories."""
        count = len(input_batch["prompts"])
        extras = input_batch.get("env_extras") or [{} for _ in range(count)]
        trajectory_ids = input_batch.get("trajectory_ids") or list(range(count))
        metadata = input_batch.get("batch_metadata")
        step = metadata.global_step if metadata is not None else self._batches
        phase = metadata.training_phase if metadata is not None else "train"
        self._batches += 1
        sampling = episode_sampling(input_batch.get("sampling_params"))
        self._salt = self._cache_salt()
        rollouts = await self._open()
        runs = [
            self._trajectory(rollouts, extra, trajectory_id, step, phase, sampling)
            for extra, trajectory_id in zip(extras, trajectory_ids, strict=True)
        ]
        done = await asyncio.gather(*runs)
        output = generator_output(
            [rollout for rollout, _, _ in done],
            trajectory_ids,
            step_wise=self._step_wise,
            mask_failed_groups=self._mask_failed_groups,
            overlong_filtering=self._overlong_filtering,
            seconds=[wall for _, wall, _ in done],
            llm_seconds=[llm for _, _, llm in done],
        )
        output["rollout_metrics"] = {**_skyrl_metrics(output), **output["rollout_metrics"]}
        return output

    async def aclose(self) -> None:
        """End the embedded trajproxy, its token server and sandboxes (the next batch would start them again)."""
        if self._rollouts is not None:
            rollouts, self._rollouts = self._rollouts, None
            await rollouts.__aexit__(None, None, None)

    def key(self, trajectory_id: Any, step: int, phase: str) -> str:
        """The episode's key and the engine's session id: unique across steps, readable in trajproxy's UI."""
        name = trajectory_id.to_string() if hasattr(trajectory_id, "to_string") else str(trajectory_id)
        return f"{self._run_name}-{phase}-step{step}-{name}"

    async def _trajectory(
        self, rollouts: Rollouts, extra: dict[str, Any], trajectory_id: Any, step: int, phase: str, sampling: Any
    ) -> tuple[Rollout, float, float]:
        """The trajectory's rollout, its wall time and the part of it spent in the engine's calls."""
        key = self.key(trajectory_id, step, phase)
        began = time.monotonic()
        try:
            if self._limit is not None:
                async with self._limit:
                    rollout = await self._run(rollouts, extra, trajectory_id, key, step, phase, sampling)
            else:
                rollout = await self._run(rollouts, extra, trajectory_id, key, step, phase, sampling)
        except Exception as e:  # the trajectory is masked, as SkyRL's generators mask a failed trial; the batch goes on
            rollout = Rollout(key, None, "failed", None, f"the rollout raised {type(e).__name__}: {e}", [])
        finally:
            self._budgets.pop(key, None)
            llm = self._llm_seconds.pop(key, 0.0)
            await self._client.finish_session(key)
        return rollout, time.monotonic() - began, llm

    async def _run(
        self,
        rollouts: Rollouts,
        extra: dict[str, Any],
        trajectory_id: Any,
        key: str,
        step: int,
        phase: str,
        sampling: dict[str, Any],
    ) -> Rollout:
        task = await self._task(extra)
        described = {
            "run": self._run_name,
            "global_step": step,
            "phase": phase,
            "trajectory_id": trajectory_id.to_string() if hasattr(trajectory_id, "to_string") else str(trajectory_id),
            "weights": self._salt,
        }
        agent = str(extra.get(EXTRA_AGENT) or self._agent)
        return await rollouts.run(task, agent, key=key, sampling=sampling, metadata={"skyrl": described})

    async def _task(self, extra: dict[str, Any]) -> Task:
        if EXTRA_TASKS not in extra:
            raise ValueError(f"env_extras has no {EXTRA_TASKS!r}: the tasks' path (and {EXTRA_TASK_ID!r}) is needed")
        where = (str(extra[EXTRA_TASKS]), str(extra[EXTRA_TASK_ID]) if extra.get(EXTRA_TASK_ID) is not None else None)
        if where not in self._tasks:
            self._tasks[where] = await asyncio.to_thread(find_task, *where)
        return self._tasks[where]

    async def _open(self) -> Rollouts:
        async with self._opening:
            if self._rollouts is None:
                rollouts = Rollouts(self._sample, **self._rollouts_options)
                self._rollouts = await rollouts.__aenter__()
            return self._rollouts

    async def _sample(self, key: str, prompt_ids: list[int], sampling: dict[str, Any]) -> Generated:
        """One parked turn, sampled by SkyRL's engine: token ids in, token ids and their logprobs out, under the
        engine's weight version when it was sent (the turn's policy version)."""
        version = getattr(self._client, "weight_version", None)
        if self._max_total_length is not None:
            budget = self._budgets.get(key)
            if budget is None:
                budget = self._budgets[key] = ResponseBudget(max(1, self._max_total_length - len(prompt_ids)))
            sampling = {**sampling, "max_tokens": budget.max_tokens(prompt_ids, sampling.get("max_tokens"))}
        request = {
            "prompt_token_ids": [prompt_ids],
            "sampling_params": {**sampling, "logprobs": 0},
            "session_ids": [key],
            "cache_salt": self._salt,
        }
        began = time.monotonic()
        try:
            out = await self._client.generate(request, model=self._model)
        finally:
            self._llm_seconds[key] = self._llm_seconds.get(key, 0.0) + time.monotonic() - began
        logprobs = out.get("response_logprobs")
        reason = out["stop_reasons"][0]
        return Generated(
            list(out["response_ids"][0]),
            list(logprobs[0]) if logprobs and logprobs[0] is not None else None,
            reason if reason in ("stop", "length", "abort") else "stop",
            str(version) if isinstance(version, int) and not isinstance(version, bool) else None,
        )

    def _cache_salt(self) -> str | None:
        """The weights' version as a prefix-cache salt, SkyRL's own (its generators' `_compute_cache_salt`), or None."""
        from skyrl.train.generators.utils import build_vllm_cache_salt  # lazy: the skyrl extra

        version = getattr(self._client, "weight_version", None)
        if not self._use_cache_salt or version is None:
            return None
        salt: str = build_vllm_cache_salt(version, self._model)
        return salt


def _skyrl_metrics(output: dict[str, Any]) -> dict[str, Any]:
    """SkyRL's own rollout metrics (lengths, rewards, times), over each trajectory's last row."""
    from skyrl.train.generators.utils import get_rollout_metrics  # lazy: the skyrl extra

    last = output["is_last_step"] or [True] * len(output["response_ids"])
    keep = [i for i, is_last in enumerate(last) if is_last]
    times, splits = output["trajectory_generation_times"], output["trajectory_time_splits"]
    metrics: dict[str, Any] = get_rollout_metrics(
        [output["response_ids"][i] for i in keep],
        [output["rewards"][i] for i in keep],
        loss_masks=[output["loss_masks"][i] for i in keep],
        trajectory_completion_times=[times[i] for i in keep] if times else None,
        trajectory_time_splits={k: [v[i] for i in keep] for k, v in splits.items()} if splits else None,
    )
    return metrics
