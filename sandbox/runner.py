"""The runner: each task becomes an episode; its agent works in a sandbox, and its diff is graded in a fresh one.

runner = Runner(trainer, sandboxes, ScriptedPolicy("solve.jsonl"), RunConfig(agent_cmd=AGENTS["minimal"]))
outcomes = await runner.run_many(tasks, concurrency=4)
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from proxy import wire
from proxy.client import AsyncTrainerClient, TrajproxyAPIError
from sandbox.agents import AGENTS
from sandbox.containers import ExecResult, Limits, SandboxError, SandboxSpec
from sandbox.docker_sandbox import DockerSandboxes
from sandbox.injection import InjectedAgent, launch_script
from sandbox.manifests import TASK_FILE
from sandbox.policies import Policy
from sandbox.tasks import Task

__all__ = ["AGENTS", "Outcome", "Progress", "RunConfig", "Runner"]

DIFF_FILE = "/tmp/trajproxy.diff"
CAPTURE_DIFF = "git add -A >/dev/null && git diff --cached --binary HEAD"
_OUTPUT_KEPT = 4000
_GIT_S = 120.0


@dataclass(frozen=True, slots=True)
class RunConfig:
    """How to run each task. The agent is `agent` (a manifest and its bundle, injected into the task's image), or
    else `agent_cmd`, a command already in the image, which may use {task_file} (the task text) and {workdir}."""

    agent_cmd: str = ""
    agent: InjectedAgent | None = None
    agent_timeout_s: float = 1800.0
    grade_timeout_s: float = 600.0
    limits: Limits = field(default_factory=Limits)
    episode: dict[str, Any] = field(default_factory=dict)  # for each episode: policy, routes, budgets (see the API)


@dataclass(frozen=True, slots=True)
class Outcome:
    task: Task
    episode_id: str | None
    status: str  # finished | failed | cancelled
    reward: float | None
    reason: str
    diff: str = ""
    agent_output: str = ""  # the tail of the agent's stdout and stderr


@dataclass(slots=True)
class Progress:
    """Counts for a live display; `on_change` gets this object after every change."""

    total: int = 0
    running: int = 0
    parked: int = 0  # LLM calls waiting on a reply (set by whoever watches the proxy)
    finished: int = 0
    failed: int = 0
    rewards: list[float] = field(default_factory=list)

    @property
    def mean_reward(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None


class Runner:
    def __init__(
        self,
        trainer: AsyncTrainerClient,
        sandboxes: DockerSandboxes,
        policy: Policy,
        config: RunConfig,
        on_change: Callable[[Progress], None] | None = None,
    ) -> None:
        self._trainer = trainer
        self._sandboxes = sandboxes
        self._policy = policy
        self._config = config
        self.progress = Progress()
        self._on_change = on_change or (lambda _progress: None)

    async def run_many(self, tasks: Iterable[Task], concurrency: int) -> list[Outcome]:
        """Run tasks, `concurrency` at a time; one task's failure never stops the others."""
        todo = list(tasks)
        self.progress.total += len(todo)
        gate = asyncio.Semaphore(concurrency)

        async def one(task: Task) -> Outcome:
            async with gate:
                return await self.run(task)

        # A TaskGroup, not gather: on Ctrl-C every task gets to close its episode before the run ends.
        async with asyncio.TaskGroup() as group:
            runs = [group.create_task(one(task)) for task in todo]
        return [run.result() for run in runs]

    async def open(self, task: Task) -> wire.EpisodeCreated:
        """A new episode for the task, as `run` would create."""
        metadata = {**task.metadata, "label": task.label, "line": task.line}
        options = dict(self._config.episode)
        if (agent := self._config.agent) is not None:
            metadata["agent"] = agent.record
            if agent.routes:
                options["routes"] = [*options.get("routes", []), *agent.routes]
        return await self._trainer.create_episode(task=task.prompt, metadata=metadata, **options)

    async def run(self, task: Task, episode: wire.EpisodeCreated | None = None) -> Outcome:
        """Run one task to its end: an episode with a reward, finished, failed or cancelled.
        `episode` is one `open` made for it already; by default the run makes its own."""
        self._count(running=1)
        episode_id = episode.id if episode else None
        try:
            if episode is None:
                episode = await self.open(task)
                episode_id = episode.id
            outcome = await self._attempt(task, episode.id, episode.key)
        except SandboxError as e:
            outcome = Outcome(task, episode_id, "failed", None, str(e))
        except asyncio.CancelledError:
            outcome = Outcome(task, episode_id, "cancelled", None, "the run was interrupted")
            await asyncio.shield(self._close(outcome))
            raise
        finally:
            self._count(running=-1)
        await self._close(outcome)
        return outcome

    async def _attempt(self, task: Task, episode_id: str, key: str) -> Outcome:
        serving = asyncio.create_task(self._policy.serve(self._trainer, episode_id))
        try:
            agent, diff = await self._work(task, episode_id, key)
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        reward, grade = await self._grade(task, episode_id, diff)
        output = _tail(agent.output)
        info = {"grader": grade, "agent_exit_code": agent.exit_code, "agent_output": output}
        await self._trainer.add_reward(episode_id, reward, "reward", source="grader", info=info)
        if agent.timed_out:
            why = f"the agent ran past its budget of {self._config.agent_timeout_s:g} s"
            return Outcome(task, episode_id, "failed", reward, why, diff, output)
        if agent.exit_code != 0:
            said = _last_line(agent.output)
            why = f"the agent exited with {agent.exit_code}" + (f": {said}" if said else "")
            return Outcome(task, episode_id, "failed", reward, why, diff, output)
        return Outcome(task, episode_id, "finished", reward, str(grade["verdict"]), diff, output)

    async def _work(self, task: Task, episode_id: str, key: str) -> tuple[ExecResult, str]:
        """Run the agent on the task in a sandbox that reaches trajproxy; returns its result and its diff."""
        base = self._sandboxes.base_url
        env = {
            "OPENAI_BASE_URL": f"{base}/v1",
            "OPENAI_API_KEY": key,
            "ANTHROPIC_BASE_URL": base,
            "ANTHROPIC_API_KEY": key,
        }
        box = await self._sandboxes.start(self._spec(task, episode_id, env=env, proxy=True, agent=self._config.agent))
        try:
            injected = self._config.agent
            if injected is None or injected.manifest.uses("task_file"):
                await box.upload(TASK_FILE, task.prompt.encode())
            if injected is not None:
                rendered = injected.render(base_url=base, key=key, task=task.prompt, workdir=task.workdir)
                command, env, user = launch_script(rendered), dict(rendered.env), rendered.user
            else:
                command = self._config.agent_cmd.format(task_file=TASK_FILE, workdir=shlex.quote(task.workdir))
                env, user = {}, ""
            agent = await box.exec(command, timeout_s=self._config.agent_timeout_s, env=env, user=user)
            diff = await box.exec(CAPTURE_DIFF, timeout_s=_GIT_S)
            if not diff.ok:
                raise SandboxError(f"could not capture the agent's changes with git in {task.workdir}: {diff.output}")
            return agent, diff.output
        finally:
            await asyncio.shield(box.stop())

    async def _grade(self, task: Task, episode_id: str, diff: str) -> tuple[float, dict[str, object]]:
        """Apply the diff to a fresh container of the task's image (no network) and run the task's eval_cmd."""
        box = await self._sandboxes.start(self._spec(task, episode_id, env={}, proxy=False))
        try:
            if diff.strip():
                await box.upload(DIFF_FILE, diff.encode())
                applied = await box.exec(f"git apply --whitespace=nowarn {DIFF_FILE}", timeout_s=_GIT_S)
                if not applied.ok:
                    return 0.0, {"verdict": "the diff does not apply", "output": _tail(applied.output)}
            result = await box.exec(task.eval_cmd, timeout_s=self._config.grade_timeout_s)
        finally:
            await asyncio.shield(box.stop())
        if result.timed_out:
            verdict = f"the grader ran past {self._config.grade_timeout_s:g} s"
        else:
            verdict = "tests pass" if result.ok else f"tests fail (exit {result.exit_code})"
        return (1.0 if result.ok else 0.0), {
            "verdict": verdict,
            "exit_code": result.exit_code,
            "output": _tail(result.output),
        }

    def _spec(
        self, task: Task, episode_id: str, *, env: dict[str, str], proxy: bool, agent: InjectedAgent | None = None
    ) -> SandboxSpec:
        return SandboxSpec(
            task.image,
            workdir=task.workdir,
            env=env,
            limits=self._config.limits,
            labels={"trajproxy.episode": episode_id},
            proxy=proxy,
            mounts=agent.mounts if agent else {},
            arch=agent.bundle.arch if agent else None,
        )

    async def _close(self, outcome: Outcome) -> None:
        if outcome.episode_id is not None:
            try:
                await self._trainer.finish(outcome.episode_id, outcome.status, outcome.reason[:2000])
            except TrajproxyAPIError as e:
                if e.status != 409:  # 409: closed already (its budget finished it): that record stands
                    raise
        if outcome.status == "finished":
            self._count(finished=1)
        else:
            self._count(failed=1)
        if outcome.reward is not None:
            self.progress.rewards.append(outcome.reward)
            self._on_change(self.progress)

    def _count(self, **changes: int) -> None:
        for name, change in changes.items():
            setattr(self.progress, name, getattr(self.progress, name) + change)
        self._on_change(self.progress)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _tail(text: str) -> str:
    return text if len(text) <= _OUTPUT_KEPT else "…" + text[-_OUTPUT_KEPT:]
