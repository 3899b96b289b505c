"""What every trainer's adapter needs: agents run on tasks in sandboxes, their calls answered through the trainer's
own generate call, each episode graded and read back as sample lines (the sample format, version 1).

    async with Rollouts(generate, tokenizer="/models/qwen") as rollouts:
        rollout = await rollouts.run(find_task("tasks.jsonl", "calc-1"), "mini-swe-agent", key="step3-traj0")
        rollout.reward, rollout.samples   # the grader's reward; one line per branch: ids, loss mask, logprobs

A `Rollouts` holds an embedded trajproxy (a SQLite file of its own unless given a database), this machine's Docker
sandboxes, and a token server (`integrations.token_server`) that serves `generate`. Each episode's policy is that
server in trajproxy's tokens mode, so the prompt ids are rendered and continued by trajproxy, sampled by the trainer's
engine, and recorded exactly as sampled; the trainer's routing, batching and weights stay its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import orjson

from integrations.token_server import Generate, Generated, TokenServer, token_server
from proxy import schema
from proxy.client import AsyncTrainerClient
from proxy.servers.embedded import embedded_proxy
from proxy.storage.export import Filters, export, source
from sandbox.agents.injection import InjectedAgent, inject
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.run.policies import TrainerPolicy
from sandbox.run.runner import Outcome, RunConfig, Runner
from sandbox.tasks.read import read_tasks
from sandbox.tasks.task import Task, TaskError

__all__ = ["Generate", "Generated", "Rollout", "Rollouts", "Served", "find_task"]


@dataclass(frozen=True, slots=True)
class Served:
    """A vLLM server trajproxy calls itself, in tokens mode, instead of a trainer's generate call: where the
    trainer serves its policy on vLLM's HTTP API (`trajproxy train`, TRL with an external server)."""

    api_base: str  # http://HOST:PORT/v1
    model: str  # its served model name


@dataclass(frozen=True, slots=True)
class Rollout:
    """One graded episode: how it ended, and its sample lines (`proxy/storage/sample.schema.json`), one per branch
    line in order; a line's `infrastructure_failure` says to drop it rather than score it."""

    key: str
    episode_id: str | None
    status: str  # finished | failed | cancelled
    reward: float | None
    reason: str
    samples: list[dict[str, Any]]


class Rollouts:
    def __init__(
        self,
        generate: Generate | Served,
        *,
        tokenizer: str,
        database_url: str | None = None,
        tool_parser: str = "hermes",
        sampling: dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        turn_timeout_s: float = 600.0,
        agent_timeout_s: float | None = None,
        labels: dict[str, str] | None = None,
        episode: dict[str, Any] | None = None,
    ) -> None:
        """`generate`: the trainer's generate call (served to trajproxy by a token server), or a vLLM server that
        trajproxy calls itself; `tokenizer`: the served model's folder (its chat template and tokenizer);
        `sampling`: every episode's sampling options, as vLLM names them (a run's own override them);
        `chat_template`: a template (its text, or a file's path) in place of the tokenizer's own, as the trainer's
        user set it (verl's `custom_chat_template`); `database_url`: where episodes are recorded (default: a SQLite
        file in a temporary folder, removed at the end); `labels`: on every sandbox container, besides trajproxy's
        own; `episode`: more of every episode's options (the API's: max_turns, max_tokens, deadline_s,
        max_staleness, ...)."""
        self._generate = generate
        self._tokenizer = tokenizer
        self._database_url = database_url
        self._options: dict[str, Any] = {"mode": "tokens", "tokenizer": tokenizer, "tool_parser": tool_parser}
        if chat_template_kwargs:
            self._options["chat_template_kwargs"] = chat_template_kwargs
        if chat_template:
            self._options["chat_template"] = chat_template
        self._sampling = dict(sampling or {})
        self._turn_timeout_s = turn_timeout_s
        self._agent_timeout_s = agent_timeout_s
        self._labels = labels or {}
        self._episode = dict(episode or {})
        self._agents: dict[str, InjectedAgent] = {}
        self._stack = contextlib.AsyncExitStack()
        self._server: TokenServer | None = None
        self._sandboxes: DockerSandboxes | None = None
        self.trainer: AsyncTrainerClient

    async def __aenter__(self) -> Self:
        stack = self._stack
        try:
            if self._database_url is None:
                folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="trajproxy-rollouts-"))
                self._database_url = f"sqlite:///{folder}/rollouts.db"
            proxy = await stack.enter_async_context(embedded_proxy(self._database_url))
            self.trainer = await stack.enter_async_context(AsyncTrainerClient(proxy.url, proxy.token))
            if not isinstance(self._generate, Served):
                self._server = await stack.enter_async_context(token_server(self._generate, self._tokenizer))
            self._sandboxes = DockerSandboxes(proxy.socket_folder, labels=self._labels)
            stack.push_async_callback(self._sandboxes.close)
        except BaseException:
            await stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def episode_options(self, key: str, sampling: dict[str, Any] | None = None) -> dict[str, Any]:
        """The options an episode is created with to be answered through `generate` under `key`."""
        if isinstance(self._generate, Served):
            api_base, model = self._generate.api_base, self._generate.model
        else:
            assert self._server is not None, "use Rollouts as an async context manager"
            api_base, model = self._server.api_base(key), self._server.model
        options = {**self._options, **self._sampling, **(sampling or {}), "api_base": api_base}
        return {
            **self._episode,
            "policy": f"vllm:{model}",
            "policy_options": options,
            "turn_timeout_s": self._turn_timeout_s,
        }

    async def open(self, key: str, sampling: dict[str, Any] | None = None, **episode: Any) -> schema.EpisodeCreated:
        """An episode answered through `generate`, for an agent run by the caller (`episode.env` is its
        environment); `episode`: more of the API's options (task, metadata, max_turns, ...)."""
        return await self.trainer.create_episode(**{**self.episode_options(key, sampling), **episode})

    async def run(
        self,
        task: Task,
        agent: str | InjectedAgent,
        *,
        key: str,
        sampling: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Rollout:
        """Run `agent` (a preset's name, a manifest's path, or one injected already) on `task` in a sandbox, its
        calls answered through `generate` under `key`; grade it; return it with its sample lines."""
        assert self._sandboxes is not None, "use Rollouts as an async context manager"
        injected = await self.agent(agent) if isinstance(agent, str) else agent
        config = RunConfig(
            agent=injected,
            agent_timeout_s=self._agent_timeout_s,
            episode=self.episode_options(key, sampling),
            metadata={"rollout_key": key, **(metadata or {})},
        )
        outcome = await Runner(self.trainer, self._sandboxes, TrainerPolicy(), config).run(task)
        return await self.rollout(key, outcome)

    async def rollout(self, key: str, outcome: Outcome) -> Rollout:
        samples = await self.samples(outcome.episode_id) if outcome.episode_id else []
        return Rollout(key, outcome.episode_id, outcome.status, outcome.reward, outcome.reason, samples)

    async def agent(self, name: str) -> InjectedAgent:
        """A preset or manifest, injected once (its bundle built on first use on this machine)."""
        if name not in self._agents:
            self._agents[name] = await asyncio.to_thread(inject, name)
        return self._agents[name]

    async def samples(self, episode_id: str) -> list[dict[str, Any]]:
        """The episode's sample lines, as `trajproxy export --shape tokens` writes them."""
        assert self._database_url is not None
        return await asyncio.to_thread(_samples, self._database_url, episode_id)


def _samples(database_url: str, episode_id: str) -> list[dict[str, Any]]:
    engine = source(database_url)
    try:
        out = io.BytesIO()
        export(engine, out, "tokens", Filters(episode_ids=(episode_id,)))
    finally:
        engine.dispose()
    return [orjson.loads(line) for line in out.getvalue().splitlines()]


def find_task(tasks: str | Path, task_id: str | None = None, image: str | None = None) -> Task:
    """The task `task_id` at `tasks` (any path `trajproxy run` takes), or its only task; TaskError says why not."""
    found: list[Task] = []
    for task in read_tasks(tasks, image=image):
        if isinstance(task, TaskError):
            if task_id is None:
                raise task
            continue
        if task_id is None or task.id == task_id:
            found.append(task)
    if len(found) != 1:
        which = f"no task {task_id!r}" if task_id is not None else f"{len(found)} tasks, and no task id to choose"
        raise TaskError(f"{tasks}: {which}")
    return found[0]


def tasks_of(path: str | Path, image: str | None = None) -> Sequence[Task]:
    """Every task at `path` that can run; TaskError for the first that cannot."""
    read = list(read_tasks(path, image=image))
    for task in read:
        if isinstance(task, TaskError):
            raise task
    return [task for task in read if isinstance(task, Task)]
