"""slime's custom generate function: each sample is an unmodified agent's episode in a Docker sandbox, its calls
answered by slime's own SGLang router, graded by its task, and returned as one `Sample` per branch line.

    python train.py ... --custom-generate-function-path integrations.slime.generate \
        --custom-reward-post-process-path integrations.slime_groups.post_process_rewards \
        --dynamic-sampling-filter-path integrations.slime_groups.drop_aborted_groups

The two hooks make slime's GRPO groups and dropped groups hold with episodes (`integrations.slime_groups`); the first
sample refuses a configuration they cannot keep to (`--partial-rollout`, `--rollout-top-p` < 1, the hooks unset),
naming what to set.

A sample names its task in `sample.metadata`, either way:

- `{"tasks": PATH, "task_id": ID}`: a task from any path `trajproxy run` takes (a slime JSONL file, Harbor task
  folders, SWE-bench instances); `task_id` may be left out when PATH holds one task;
- a row of slime's own JSONL (`metadata.image`, `metadata.workdir`, `metadata.eval_cmd`; `remote_env_info` too): the
  sample itself is the task, its `prompt` the instruction, as `trajproxy run` reads such a file.

`metadata.agent` picks the agent for one sample; otherwise `args.trajproxy_agent`, then `$TRAJPROXY_SLIME_AGENT`,
then `minimal` (a preset's name or a manifest's path). The model's tokenizer and chat template are
`args.hf_checkpoint`'s, with `args.apply_chat_template_kwargs`. More settings, from the environment:

| variable | what it sets |
|---|---|
| `TRAJPROXY_SLIME_DATABASE_URL` | where episodes are recorded (default: a SQLite file removed when the process ends) |
| `TRAJPROXY_SLIME_TOOL_PARSER` | how tool calls are read from the output: `hermes` (default), `qwen3_coder`, ... |
| `TRAJPROXY_SLIME_TURN_TIMEOUT_S`, `TRAJPROXY_SLIME_AGENT_TIMEOUT_S` | how long a call, and an agent, may take |
| `TRAJPROXY_SLIME_LABELS` | a JSON object of labels put on every sandbox container |
| `TRAJPROXY_SLIME_REWARD` | each Sample's reward: `full` (default: the episode's, on each of its Samples) or `split` |

trajproxy renders and continues each call's prompt ids (`integrations.rollouts`); `RouterGenerate` sends them to the
router's `/generate` (`input_ids`, `sampling_params`, `return_logprob`), routed by the sample's `session_id` in the
`X-SMG-Routing-Key` header, so one episode's calls reach one engine and reuse its prefix cache. After slime aborts
its engines at the end of a rollout step, the agents still running get their calls refused at once: their episodes
end as infrastructure failures, their samples ABORTED.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from integrations.rollouts import Generated, Rollout, Rollouts, find_task
from integrations.slime_groups import check, reward_convention
from integrations.token_server import ResponseBudget
from proxy.adapters.chat_templates import ChatTemplates
from sandbox.tasks.formats import jsonl
from sandbox.tasks.task import Task

ROUTING_HEADER = "X-SMG-Routing-Key"
DEFAULT_AGENT = "minimal"


@dataclass
class RouterGenerate:
    """The `Generate` of `Rollouts` as a call to SGLang's native `/generate` (slime's router or one engine): the
    sampled ids and their logprobs from `meta_info.output_token_logprobs`, as slime's own rollout reads them.
    `aborted`: asked before each call; when it says so the call is refused unsent (slime is aborting its engines).
    `budgets`: a rollout's response budget over its calls, by key (`rollout_max_response_len` for each episode)."""

    url: str  # http://HOST:PORT/generate
    aborted: Callable[[], bool] = lambda: False
    timeout_s: float = 3600.0
    budgets: dict[str, ResponseBudget] = field(default_factory=dict)
    _session: aiohttp.ClientSession | None = field(default=None, init=False, repr=False)

    async def __call__(self, key: str, prompt_ids: list[int], sampling: dict[str, Any]) -> Generated:
        if self.aborted():
            return Generated([], None, "abort")
        if (budget := self.budgets.get(key)) is not None:
            sampling = {**sampling, "max_tokens": budget.max_tokens(prompt_ids, sampling.get("max_tokens"))}
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(self.timeout_s))
        payload = {"input_ids": prompt_ids, "sampling_params": sglang_params(sampling), "return_logprob": True}
        async with self._session.post(self.url, json=payload, headers={ROUTING_HEADER: key}) as answer:
            if answer.status != 200:
                raise RuntimeError(f"SGLang's /generate answered {answer.status}: {(await answer.text())[:300]}")
            return generated_of(await answer.json())

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def sglang_params(sampling: dict[str, Any]) -> dict[str, Any]:
    """An episode's sampling options (vLLM's names, as trajproxy records them) as SGLang's `sampling_params`."""
    params = dict(sampling)
    if "max_tokens" in params:
        params["max_new_tokens"] = params.pop("max_tokens")
    return params


def episode_sampling(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """slime's `sampling_params` (SGLang's names) as an episode's sampling options: only the token budget is named
    otherwise (`max_tokens`); every other option reaches `/generate` as slime gave it."""
    sampling = dict(sampling_params)
    if "max_new_tokens" in sampling:
        sampling["max_tokens"] = sampling.pop("max_new_tokens")
    return sampling


def generated_of(response: dict[str, Any]) -> Generated:
    """What SGLang's `/generate` sampled: ids and logprobs from `output_token_logprobs` ([logprob, id, text] per
    token), else `output_ids` without logprobs; why it stopped from `finish_reason.type`; the weights that sampled
    from `weight_version` (each turn's policy version: the Samples' `weight_versions`)."""
    meta = response.get("meta_info") or {}
    entries = meta.get("output_token_logprobs")
    if entries:
        ids, logprobs = [int(entry[1]) for entry in entries], [float(entry[0]) for entry in entries]
    else:
        ids, logprobs = [int(i) for i in response.get("output_ids") or []], None
    finish = meta.get("finish_reason")
    why = finish.get("type") if isinstance(finish, dict) else finish
    version = meta.get("weight_version")  # the engine's weights, as slime's own rollout reads them
    named = str(version) if isinstance(version, str | int) and not isinstance(version, bool) else None
    return Generated(ids, logprobs, why if why in ("length", "abort") else "stop", named)


def task_of(sample: Any) -> Task:
    """The task a slime sample names in its metadata (see the module's docstring)."""
    metadata = sample.metadata or {}
    if "tasks" in metadata:
        task_id = metadata.get("task_id")
        return find_task(str(metadata["tasks"]), str(task_id) if task_id is not None else None)
    row = {"prompt": sample.prompt, "label": sample.label, "metadata": metadata}
    return jsonl.parse(row, line=0)


def samples_of(
    lines: Sequence[dict[str, Any]],
    base: Any,
    decode: Callable[[list[int]], str] | None = None,
    reward: str = "full",
) -> list[Any]:
    """An episode's sample lines (`proxy/storage/sample.schema.json`) as slime `Sample`s, one per line, in order:
    `tokens` the line's prompt and completion ids, `loss_mask` and `rollout_log_probs` over its completion, the
    episode's whole reward on each (`reward="full"`, as slime's own agent path does) or the reward split over its
    trainable lines (`"split"`: `reward_split`), `rollout_id` the episode's (shared by every line, so slime's loss
    counts the episode once), `weight_versions` each turn's policy version, `index`, `group_index`, `prompt`,
    `label`, `session_id` the base sample's. A line of an infrastructure failure is ABORTED, with no loss and reward
    0.0 (`slime_groups.drop_aborted_groups` drops its group); one cut by the token budget is TRUNCATED; others
    COMPLETED."""
    from slime.utils.types import Sample  # lazy: slime, installed from its repository, loads only in its run

    samples = []
    for line in lines:
        completion = list(line["completion_ids"])
        failed = bool(line["infrastructure_failure"])
        status = Sample.Status.COMPLETED
        if failed:
            status = Sample.Status.ABORTED
        elif line["stop_reason"] == "length":
            status = Sample.Status.TRUNCATED
        logprobs = line["logprobs"]
        samples.append(
            Sample(
                index=base.index,
                group_index=base.group_index,
                rollout_id=line["rollout_id"],
                prompt=base.prompt,
                label=base.label,
                tokens=[*line["prompt_ids"], *completion],
                response=decode(completion) if decode is not None else "",
                response_length=len(completion),
                loss_mask=[0] * len(completion) if failed else list(line["loss_mask"]),
                rollout_log_probs=list(logprobs) if logprobs is not None else None,
                reward=0.0 if failed else line["reward" if reward == "full" else "reward_split"],
                remove_sample=failed,
                status=status,
                weight_versions=[v for v in line["policy_versions"] if v is not None],
                session_id=base.session_id,
                metadata={**(base.metadata or {}), "trajproxy": _provenance(line)},
            )
        )
    return samples


def _provenance(line: dict[str, Any]) -> dict[str, Any]:
    keys = ("episode_id", "branch", "turn_ids", "rewards", "reward", "stop_reason", "failure_reason", "drifts")
    return {key: line[key] for key in keys}


def aborted_sample(base: Any, reason: str) -> Any:
    """The base sample marked ABORTED, for an episode with no line to train on (its sandbox never started, its agent
    made no call): a placeholder slime drops, shaped as slime's own coding-agent example makes it."""
    from slime.utils.types import Sample  # lazy: slime, installed from its repository, loads only in its run

    base.tokens, base.response, base.response_length = [0, 0], "", 1
    base.loss_mask, base.rollout_log_probs = [0], [0.0]
    base.reward, base.remove_sample, base.status = 0.0, True, Sample.Status.ABORTED
    base.metadata = {**(base.metadata or {}), "trajproxy": {"abort_reason": reason}}
    return base


class Service:
    """One `Rollouts` per process and event loop, made at the first sample: slime loads a generate function by its
    path and calls it with `args` alone, so what outlives one call (the embedded trajproxy, the token server, the
    built agent bundles) is kept here."""

    def __init__(self, args: Any) -> None:
        check(args)  # slime settings the episodes' Samples cannot keep to are refused here, before any episode
        self.reward = reward_convention()
        url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
        self.generate = RouterGenerate(url, aborted=_slime_aborting)
        env = os.environ
        agent_timeout = env.get("TRAJPROXY_SLIME_AGENT_TIMEOUT_S")
        self.rollouts = Rollouts(
            self.generate,
            tokenizer=args.hf_checkpoint,
            database_url=env.get("TRAJPROXY_SLIME_DATABASE_URL") or None,
            tool_parser=env.get("TRAJPROXY_SLIME_TOOL_PARSER") or "hermes",
            chat_template_kwargs=getattr(args, "apply_chat_template_kwargs", None) or None,
            turn_timeout_s=float(env.get("TRAJPROXY_SLIME_TURN_TIMEOUT_S") or 600),
            agent_timeout_s=float(agent_timeout) if agent_timeout else None,
            labels=json.loads(env.get("TRAJPROXY_SLIME_LABELS") or "{}"),
        )
        self.agent = getattr(args, "trajproxy_agent", None) or env.get("TRAJPROXY_SLIME_AGENT") or DEFAULT_AGENT
        self.tokenizer = str(args.hf_checkpoint)
        self.decode: Callable[[list[int]], str] | None = None

    async def start(self) -> None:
        await self.rollouts.__aenter__()
        template = await asyncio.to_thread(ChatTemplates().get, self.tokenizer)
        self.decode = template.decode

    async def close(self) -> None:
        try:
            await self.rollouts.__aexit__(None, None, None)
        finally:
            await self.generate.aclose()


_services: dict[asyncio.AbstractEventLoop, Service] = {}
_starting: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}


async def service(args: Any) -> Service:
    """This loop's Service, started on first use."""
    loop = asyncio.get_running_loop()
    async with _starting.setdefault(loop, asyncio.Lock()):
        if loop not in _services:
            made = Service(args)
            await made.start()
            _services[loop] = made
    return _services[loop]


async def close() -> None:
    """Stop this loop's Service (its trajproxy, token server and sandboxes); the next sample starts another."""
    made = _services.pop(asyncio.get_running_loop(), None)
    if made is not None:
        await made.close()


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> list[Any]:
    """slime's custom generate function: run the sample's task with the agent, return its branch lines as Samples
    (see `samples_of`). In evaluation, one Sample: the main line, with the episode's whole reward."""
    running = await service(args)
    if not sample.session_id:
        sample.session_id = str(uuid.uuid4())
    agent = (sample.metadata or {}).get("agent") or running.agent
    sampling = episode_sampling(sampling_params)
    # the episode's calls together get slime's response budget (`rollout_max_response_len`), not each call
    total = getattr(args, "rollout_max_response_len", None) or sampling.get("max_tokens")
    if total:
        running.generate.budgets[sample.session_id] = ResponseBudget(int(total))
    try:
        rollout = await running.rollouts.run(
            task_of(sample),
            agent,
            key=sample.session_id,
            sampling=sampling,
            metadata={"slime_index": sample.index, "slime_group_index": sample.group_index},
        )
    finally:
        running.generate.budgets.pop(sample.session_id, None)
    samples = samples_of(rollout.samples, sample, running.decode, running.reward)
    if not samples:
        return [aborted_sample(sample, _why_empty(rollout))]
    if evaluation:
        main = samples[0]
        main.reward = rollout.reward if rollout.reward is not None else 0.0
        return [main]
    return samples


def _why_empty(rollout: Rollout) -> str:
    return f"the episode ({rollout.status}) has no call to train on: {rollout.reason or 'no reason given'}"


def _slime_aborting() -> bool:
    """Whether slime's rollout is aborting its engines (its GenerateState says so), so no more calls should go."""
    rollout = sys.modules.get("slime.rollout.sglang_rollout")  # loaded where slime's rollout calls this function
    if rollout is None:
        return False
    state = rollout.GenerateState._instances.get(rollout.GenerateState)
    return bool(getattr(state, "aborted", False))
