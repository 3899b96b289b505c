"""verl's agent loop for trajproxy: a dataset row names a task and an agent; the loop runs that unmodified agent on the
task in a Docker sandbox, answers each of its LLM calls with verl's own `server_manager.generate` (token in, token
out: trajproxy renders and continues the prompt ids, verl's engine samples them), grades it, and hands verl the
episode's recorded ids as an `AgentLoopOutput`.

    # agent_loops.yaml, named by actor_rollout_ref.rollout.agent.agent_loop_config_path
    - name: trajproxy
      _target_: integrations.verl.TrajproxyAgentLoop
      database_dir: /data/trajproxy        # optional: where each worker's SQLite file lies (default: a temp folder)

    # a dataset row: agent_name "trajproxy", extra_info {"tasks": "/data/tasks.jsonl", "task_id": "calc-1",
    #                 "agent": "mini-swe-agent"}

What verl gets (`agent_loop_output`, a plain function of the episode's sample lines,
`proxy/storage/sample.schema.json`): prompt_ids, response_ids (completion_ids), response_mask (loss_mask: 1 on ids
verl's engine sampled, 0 on the ids the environment and the chat template added), response_logprobs (the engine's,
when verl asks for them), reward_score (the grader's), num_turns, metrics and `extra_fields["trajproxy"]` (episode id,
branch, turn ids, policy versions, cuts, infrastructure failure, the lines not trained). docs/trainers/verl.md says
what a verl user sets and what is lost.

verl's classic worker takes one sequence per `run`: an episode whose agent rewrote its history (several lines) trains
its line with the most sampled ids and reports the others, untrained, in extra_fields; `branches: all` returns every
line as a list, for verl's TransferQueue (v1) worker (`trainer.use_v1: true`, verl 0.9.1's default), which takes
several outputs per run; the classic worker cannot, so the loop refuses `all` there before any episode.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    _agent_loop_registry,
)

from integrations.rollouts import Generated, Rollouts, find_task
from integrations.token_server import ResponseBudget
from integrations.verl_outputs import agent_loop_output, agent_loop_outputs, policy_version
from sandbox.tasks.task import Task

__all__ = ["TrajproxyAgentLoop", "agent_loop_output", "agent_loop_outputs", "close"]

# verl's sampling options that the episode takes as they are (vLLM spells them alike); verl's win over a row's own
VERL_SAMPLING = ("temperature", "top_p", "top_k", "repetition_penalty")
# what of verl's row an episode's metadata keeps (under "verl"): the v1 worker's sample key is {uid}_{session_id}_{i}
VERL_ROW = ("index", "uid", "data_source", "session_id", "global_steps")


@dataclass
class _Calls:
    """One rollout's calls into verl's engine: how long they took, where its response budget stands, which weights
    (verl's global steps) answered them."""

    loop: TrajproxyAgentLoop
    sampling: dict[str, Any]
    budget: ResponseBudget
    generate_s: float = 0.0
    preempted: int = 0
    global_steps: list[int] = field(default_factory=list)


class _Worker:
    """What one verl agent-loop worker process holds across the loops it makes (verl makes a loop per row): one
    `Rollouts` (an embedded trajproxy, the Docker sandboxes, the token server), the tasks read, and each running
    rollout's calls by key, through which `generate` reaches the `server_manager` of the loop that runs it."""

    def __init__(self) -> None:
        self.rollouts: Rollouts | None = None
        self.options: dict[str, Any] = {}
        self.calls: dict[str, _Calls] = {}
        self.tasks: dict[tuple[str, str | None, str | None], Task] = {}
        self.opening = asyncio.Lock()
        self.gate: asyncio.Semaphore | None = None

    async def open(self, loop: TrajproxyAgentLoop) -> tuple[Rollouts, asyncio.Semaphore]:
        """The worker's Rollouts and the gate that holds it to `max_episodes` episodes (sandboxes) at once, both made
        from the first loop's options; a loop of another entry of verl's agent-loop file whose options for them
        differ is refused (one worker runs one trajproxy)."""
        options = {**loop.rollouts_options(), "max_episodes": loop.max_episodes}
        async with self.opening:
            if self.rollouts is None:
                rollouts = Rollouts(self.generate, **{k: v for k, v in options.items() if k != "max_episodes"})
                self.rollouts = await rollouts.__aenter__()  # held for the worker's life: verl has no close hook
                self.options, self.gate = options, asyncio.Semaphore(loop.max_episodes)
        differ = sorted(name for name in options if options[name] != self.options[name])
        if differ:
            raise ValueError(
                f"trajproxy agent loop options {', '.join(differ)}: one verl agent-loop worker runs one trajproxy, "
                "made from its first loop's entry; give every trajproxy entry of the agent-loop file the same values"
            )
        assert self.gate is not None
        return self.rollouts, self.gate

    async def generate(self, key: str, prompt_ids: list[int], sampling: dict[str, Any]) -> Generated:
        calls = self.calls[key]
        loop = calls.loop
        max_tokens = calls.budget.max_tokens(prompt_ids, sampling.get("max_tokens"))
        params = engine_params({**sampling, **calls.sampling, "max_tokens": max_tokens}, loop.rollout_config.name)
        began = time.perf_counter()
        try:
            output = await loop.server_manager.generate(request_id=key, prompt_ids=prompt_ids, sampling_params=params)
        finally:
            calls.generate_s += time.perf_counter() - began
        calls.preempted += output.num_preempted or 0
        for name in ("min_global_steps", "max_global_steps", "global_steps"):
            if isinstance(output.extra_fields.get(name), int):
                calls.global_steps.append(output.extra_fields[name])
        version = policy_version(output.extra_fields)
        ids = list(output.token_ids)
        if output.stop_reason in ("aborted", "abort"):
            finish = "abort"
        elif output.stop_reason == "length" or len(ids) >= max_tokens:
            finish = "length"
        else:
            finish = "stop"
        return Generated(ids, list(output.log_probs) if output.log_probs is not None else None, finish, version)


_worker: _Worker | None = None  # one per process: verl builds agent loops per row, with no place to keep a Rollouts


def _this_worker() -> _Worker:
    global _worker
    if _worker is None:
        _worker = _Worker()
    return _worker


async def close() -> None:
    """Closes this process's Rollouts (its trajproxy, sandboxes and token server), for a program that drives the loop
    itself and ends; verl's workers have no hook for it, and their processes simply end."""
    global _worker
    worker, _worker = _worker, None
    if worker is not None and worker.rollouts is not None:
        await worker.rollouts.__aexit__(None, None, None)


class TrajproxyAgentLoop(AgentLoopBase):  # type: ignore[misc]
    """Runs the row's task with the row's agent through trajproxy; see the module's docstring."""

    def __init__(
        self,
        *args: Any,
        database_dir: str | None = None,
        database_url: str | None = None,
        agent: str | None = None,
        branches: str = "main",
        tool_parser: str = "hermes",
        sampling: dict[str, Any] | None = None,
        turn_timeout_s: float = 600.0,
        agent_timeout_s: float | None = None,
        labels: dict[str, str] | None = None,
        max_episodes: int = 16,
        **kwargs: Any,
    ) -> None:
        """Options come from the loop's entry in verl's agent-loop config file; verl passes the rest.
        `max_episodes`: how many episodes (sandboxes) one worker runs at once; its other rows wait their turn (verl's
        classic worker starts a batch's rows at once, its v1 worker every row's `rollout.n` sessions)."""
        super().__init__(*args, **kwargs)
        if max_episodes < 1:
            raise ValueError(f"max_episodes: at least 1, not {max_episodes}")
        if branches == "all" and not (self.config.get("trainer") or {}).get("use_v1", True):  # verl 0.9.1: true
            raise ValueError(
                "branches: all returns several outputs per run, which only verl's v1 worker takes "
                "(trainer.use_v1: true); the classic worker (trainer.use_v1: false) takes one: use branches: main"
            )
        self.max_episodes = max_episodes
        self.database_dir = database_dir
        self.database_url = database_url
        self.agent = agent
        self.branches = branches
        self.tool_parser = tool_parser
        self.sampling = _plain(sampling or {})
        self.turn_timeout_s = turn_timeout_s
        self.agent_timeout_s = agent_timeout_s
        self.labels = _plain(labels or {})

    def rollouts_options(self) -> dict[str, Any]:
        """The worker's Rollouts: the tokenizer verl loaded (its local folder), this loop's database and options."""
        database_url = self.database_url
        if database_url is None and self.database_dir is not None:
            Path(self.database_dir).mkdir(parents=True, exist_ok=True)
            database_url = f"sqlite:///{Path(self.database_dir).resolve()}/rollouts-{os.getpid()}.db"
        kwargs = self.apply_chat_template_kwargs
        model = self.config.actor_rollout_ref.model
        return {
            "tokenizer": self.tokenizer.name_or_path,
            "chat_template": model.get("custom_chat_template") if hasattr(model, "get") else None,
            "database_url": database_url,
            "tool_parser": self.tool_parser,
            "chat_template_kwargs": dict(kwargs) if kwargs else None,
            "turn_timeout_s": self.turn_timeout_s,
            "agent_timeout_s": self.agent_timeout_s,
            "labels": self.labels,
        }

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput | list[AgentLoopOutput]:
        """One sandboxed, graded episode of the row's task (`extra_info`: tasks, task_id, agent, image, sampling)."""
        worker = _this_worker()
        rollouts, gate = await worker.open(self)
        row = _plain(kwargs.get("extra_info") or {})
        agent = row.get("agent") or self.agent
        if not row.get("tasks") or not agent:
            raise ValueError("a trajproxy row needs extra_info.tasks and an agent (extra_info.agent or the loop's)")
        task = await self.task(worker, str(row["tasks"]), row.get("task_id"), row.get("image"))
        sampling = {**self.sampling, **dict(row.get("sampling") or {}), **_vllm_sampling(sampling_params)}
        asked = {"logprobs": bool(sampling_params.get("logprobs"))}
        engine_params({**sampling, **asked}, self.rollout_config.name)  # refused before the episode
        key = uuid.uuid4().hex
        budget = ResponseBudget(self.rollout_config.response_length)
        async with gate:
            calls = worker.calls[key] = _Calls(self, asked, budget)
            began = time.perf_counter()
            try:
                metadata = {"verl": {k: _plain(kwargs[k]) for k in VERL_ROW if k in kwargs}}
                rollout = await rollouts.run(task, str(agent), key=key, sampling=sampling, metadata=metadata)
            finally:
                del worker.calls[key]
        wall_s = time.perf_counter() - began
        fields = agent_loop_outputs(
            rollout,
            prompt_length=self.rollout_config.prompt_length,
            response_length=self.rollout_config.response_length,
            logprobs=bool(sampling_params.get("logprobs")),
            branches=self.branches,
            fallback_prompt_ids=self.tokenizer.encode(task.prompt),
            pad_id=self.tokenizer.pad_token_id or 0,
        )
        metrics = AgentLoopMetrics(
            generate_sequences=calls.generate_s, tool_calls=max(0.0, wall_s - calls.generate_s), num_preempted=-1
        )
        outputs = []
        for output in fields:
            if calls.global_steps:
                output["extra_fields"]["min_global_steps"] = min(calls.global_steps)
                output["extra_fields"]["max_global_steps"] = max(calls.global_steps)
            outputs.append(AgentLoopOutput(**output, metrics=metrics))
        return outputs if self.branches == "all" else outputs[0]

    async def task(self, worker: _Worker, tasks: str, task_id: str | None, image: str | None) -> Task:
        """The row's task, read once per worker."""
        found = worker.tasks.get((tasks, task_id, image))
        if found is None:
            found = worker.tasks[(tasks, task_id, image)] = await asyncio.to_thread(find_task, tasks, task_id, image)
        return found


# The name `trajproxy` for a row's agent_name, unless the agent-loop file already gave it its own entry (with options):
# verl's `register` would replace that entry, and verl's worker reads the file before a loop is first made, which is
# where hydra may first import this module (to make a row of another entry), leaving the file's later rows the defaults.
_agent_loop_registry.setdefault("trajproxy", {"_target_": f"{__name__}.{TrajproxyAgentLoop.__qualname__}"})


def engine_params(params: dict[str, Any], backend: str) -> dict[str, Any]:
    """A call's sampling options as verl's vLLM server takes them: it builds `vllm.SamplingParams(**params)`, where an
    unknown name is an error in the engine, mid-episode; here it is refused before the episode starts, naming it.
    `structured_outputs`, given as vLLM's HTTP API spells it (a mapping), becomes vLLM's `StructuredOutputsParams`,
    which `SamplingParams` needs and does not convert. Another backend's options pass as they are."""
    if backend != "vllm":
        return params
    try:
        from vllm import SamplingParams  # lazy: verl's vLLM rollout has it; nothing else here needs it
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError:
        return params
    unknown = sorted(set(params) - set(SamplingParams.__struct_fields__))
    if unknown:
        raise ValueError(
            f"sampling option(s) {', '.join(unknown)}: verl's vLLM server passes a call's sampling options to "
            "vllm.SamplingParams, which has no such field (the loop's `sampling`, the row's extra_info.sampling)"
        )
    structured = params.get("structured_outputs")
    if isinstance(structured, Mapping):
        params = {**params, "structured_outputs": StructuredOutputsParams(**structured)}
    return params


def _vllm_sampling(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """verl's sampling options for the episode, as vLLM names them (the same names; verl's `logprobs` flag is the
    adapter's to honour, not the episode's)."""
    return {name: sampling_params[name] for name in VERL_SAMPLING if sampling_params.get(name) is not None}


def _plain(value: Any) -> Any:
    """A value from verl (an omegaconf mapping or list from its config, a numpy scalar from its batch) as the plain
    value JSON can hold."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_plain(v) for v in value]
    return _plain(value.tolist()) if hasattr(value, "tolist") else value  # numpy: arrays and scalars
