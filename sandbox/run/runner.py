"""The runner: each task becomes an episode; its agent works in a sandbox, and its work is graded: in a fresh
container of the task's image with the agent's diff applied, or in place, in the agent's own once it has stopped.

runner = Runner(trainer, sandboxes, ScriptedPolicy("solve.jsonl"), RunConfig(agent=inject("minimal")))
outcomes = await runner.run_many(tasks, concurrency=4)
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import shlex
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from proxy import schema
from proxy.client import AsyncTrainerClient, TrajproxyAPIError
from proxy.dialects.dialect import agent_env
from sandbox.agents.injection import InjectedAgent, launch_script
from sandbox.agents.manifests import TASK_FILE
from sandbox.backends.interface import (
    SCRATCH_BYTES,
    ExecResult,
    Limits,
    ReadOnlyRoot,
    Sandbox,
    SandboxError,
    Sandboxes,
    SandboxLost,
    SandboxSpec,
)
from sandbox.run.policies import Policy
from sandbox.tasks.task import Grade, GradingMode, Task, tail

__all__ = ["Outcome", "Progress", "RunConfig", "Runner"]

DIFF_FILE = "/tmp/trajproxy.diff"
CAPTURE_DIFF = "git add -A >/dev/null && git diff --cached --binary HEAD"
# As SWE-bench's harness applies a patch: git first, then patch(1) with some fuzz where the image has it.
APPLY_DIFF = (
    f"git apply --whitespace=nowarn {DIFF_FILE} || "
    f"(command -v patch >/dev/null && patch --batch --fuzz=5 -p1 -i {DIFF_FILE})"
)
DIFF_KEPT = 1024 * 1024  # of the agent's diff, recorded with its reward for the episode page (characters)
DEFAULT_AGENT_TIMEOUT_S = 1800.0
DEFAULT_GRADE_TIMEOUT_S = 600.0
_GIT_S = 120.0
SETUP_TIMEOUT_S = 600.0
START_ALLOWANCE_S = 300.0  # of an episode's default deadline: its sandboxes' starts and the diff's capture
# An episode whose budget refused its agent's call ends finished, its reason opening so: a truncation of the
# policy's attempt (graded, trained on), not an infrastructure failure; the agent's refused call got its 429.
TRUNCATED = "truncated: "
BUDGETS = frozenset({"max_turns", "max_tokens", "deadline_s"})  # the episode options that make a budget
LOST_RUNS = 3  # a task whose sandbox's machine dies runs again elsewhere, at most this many times in all


@dataclass(frozen=True, slots=True)
class RunConfig:
    """How to run each task. The agent is `agent` (a manifest and its bundle, injected into the task's image:
    `sandbox.agents.injection.inject`), or else `agent_cmd`, a command already in the image (`--agent-cmd`), which
    may use {task_file} (the task text) and {workdir}.
    What is left None here comes from each task (a Harbor task's timeouts and resources), else the defaults."""

    agent_cmd: str = ""
    agent: InjectedAgent | None = None
    oracle: bool = False  # instead of an agent, run each task's own solution
    agent_timeout_s: float | None = None  # None: the task's own, else DEFAULT_AGENT_TIMEOUT_S
    grade_timeout_s: float | None = None  # None: the task's own, else DEFAULT_GRADE_TIMEOUT_S
    grading: GradingMode | None = None  # None: the task format's own
    limits: Limits | None = None  # None: the task's own, else Limits()
    read_only: bool | None = None  # the agent's root filesystem read-only; None: as the task says, else writable
    scratch_bytes: int = SCRATCH_BYTES  # of a read-only root: the size of each scratch folder (/tmp)
    episode_timeout_s: float | None = None  # start to graded; None: agent + grade budgets + START_ALLOWANCE_S
    episode: dict[str, Any] = field(default_factory=dict)  # for each episode: policy, routes, budgets (see the API)
    metadata: dict[str, Any] = field(
        default_factory=dict
    )  # in each episode's metadata: who ran it (sandbox.run.resume)


@dataclass(frozen=True, slots=True)
class Outcome:
    task: Task
    episode_id: str | None
    status: str  # finished | failed | cancelled
    reward: float | None
    reason: str
    diff: str = ""
    agent_output: str = ""  # the tail of the agent's stdout and stderr
    timings: dict[str, float] = field(default_factory=dict)  # build_s start_s agent_s grade_s total_s, those that ran
    lost: bool = False  # its sandbox's machine died: the task runs again elsewhere (`run_many`)


@dataclass(slots=True)
class Progress:
    """Counts for a live display; `on_change` gets this object after every change."""

    total: int = 0
    running: int = 0
    parked: int = 0  # LLM calls waiting on a reply (set by whoever watches the proxy)
    finished: int = 0
    failed: int = 0
    cancelled: int = 0  # stopped by a signal: neither done nor failed
    rewards: list[float] = field(default_factory=list)

    @property
    def mean_reward(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None


class Runner:
    def __init__(
        self,
        trainer: AsyncTrainerClient,
        sandboxes: Sandboxes,
        policy: Policy,
        config: RunConfig,
        on_change: Callable[[Progress], None] | None = None,
        on_outcome: Callable[[Outcome], None] | None = None,
    ) -> None:
        self._trainer = trainer
        self._sandboxes = sandboxes
        self._policy = policy
        self._config = config
        self.progress = Progress()
        self._on_change = on_change or (lambda _progress: None)
        self._on_outcome = on_outcome or (lambda _outcome: None)  # each task's outcome, as soon as it ends

    async def run_many(
        self, tasks: Iterable[Task], concurrency: int, episodes: Sequence[schema.EpisodeCreated] = ()
    ) -> list[Outcome]:
        """Run tasks, `concurrency` at a time; one task's failure never stops the others. With `episodes` (one
        per task, e.g. forks of a recorded episode), each task runs in its episode instead of a new one."""
        todo = list(tasks)
        self.progress.total += len(todo)
        gate = asyncio.Semaphore(concurrency)

        async def one(task: Task, episode: schema.EpisodeCreated | None) -> Outcome:
            async with gate:
                outcome = await self.run(task, episode)
                for _ in range(LOST_RUNS - 1):  # its episode is recorded failed with no reward; a new one runs
                    if not outcome.lost or episode is not None:  # a fork's episode is given: it cannot run again
                        break
                    outcome = await self.run(task)
                if outcome.lost:  # lost every time (or a fork's): that is its end
                    outcome = dataclasses.replace(outcome, lost=False)
                    self._count(failed=1)
                    self._on_outcome(outcome)
                return outcome

        # A TaskGroup, not gather: on Ctrl-C every task gets to close its episode before the run ends.
        async with asyncio.TaskGroup() as group:
            runs = [group.create_task(one(task, episodes[i] if episodes else None)) for i, task in enumerate(todo)]
        return [run.result() for run in runs]

    async def open(self, task: Task) -> schema.EpisodeCreated:
        """A new episode for the task, as `run` would create."""
        metadata = {**task.metadata, **self._config.metadata}
        metadata |= {"task_id": task.id, "label": task.label, "line": task.line}
        options = dict(self._config.episode)
        if (agent := self._config.agent) is not None:
            metadata["agent"] = agent.record
            if agent.routes:
                options["routes"] = [*options.get("routes", []), *agent.routes]
        elif self._config.oracle or self._config.agent_cmd:  # named as the run's --agent or --agent-cmd was
            metadata["agent"] = {"name": "oracle" if self._config.oracle else f"--agent-cmd {self._config.agent_cmd}"}
        return await self._trainer.create_episode(task=task.prompt, metadata=metadata, **options)

    async def run(self, task: Task, episode: schema.EpisodeCreated | None = None) -> Outcome:
        """Run one task to its end: an episode with a reward, finished, failed or cancelled.
        `episode` is one `open` made for it already; by default the run makes its own."""
        self._count(running=1)
        episode_id = episode.id if episode else None
        try:
            if episode is None:
                episode = await self.open(task)
                episode_id = episode.id
            deadline = asyncio.timeout(self._deadline_s(task))  # a wedged start, agent or grader: cancelled, removed
            try:
                async with deadline:
                    outcome = await self._attempt(task, episode.id, episode.key)
            except TimeoutError:
                if not deadline.expired():
                    raise
                said = f"the episode ran past its deadline of {self._deadline_s(task):g} s (start to graded)"
                outcome = Outcome(task, episode_id, "failed", None, said)
        except SandboxLost as e:
            outcome = Outcome(task, episode_id, "failed", None, f"{e}; the task runs again elsewhere", lost=True)
        except SandboxError as e:
            outcome = Outcome(task, episode_id, "failed", None, str(e))
        except asyncio.CancelledError:
            outcome = Outcome(task, episode_id, "cancelled", None, "the run was interrupted")
            await asyncio.shield(self._close(outcome))
            raise
        finally:
            self._count(running=-1)
        await self._close(outcome)
        if not outcome.lost:  # a lost task's outcome is the one of its run elsewhere
            self._on_outcome(outcome)
        return outcome

    async def _attempt(self, task: Task, episode_id: str, key: str) -> Outcome:
        timings: dict[str, float] = {}
        began = time.monotonic()
        if task.build is not None:
            await self._sandboxes.build(task.build, task.image, task.build_timeout_s)
            timings["build_s"] = round(time.monotonic() - began, 3)
        mode = self._config.grading or task.grading
        grade: Grade | None = None
        clock = time.monotonic()
        box = await self._sandboxes.start(self._agent_spec(task, episode_id, key))
        timings["start_s"] = round(time.monotonic() - clock, 3)
        try:
            clock = time.monotonic()
            await _set_up(box, task)
            agent = await self._act(box, task, episode_id, key)
            timings["agent_s"] = round(time.monotonic() - clock, 3)
            diff = await self._diff(box, task, needed=mode == "fresh")
            clock = time.monotonic()
            if mode == "in-place":  # the agent's process has ended; its container and what it left remain
                grade = await task.grader.grade(box, self._grade_timeout_s(task))
        finally:
            await asyncio.shield(box.stop())
        if grade is None:
            grade = await self._grade_fresh(task, episode_id, diff)
        timings["grade_s"] = round(time.monotonic() - clock, 3)
        timings["total_s"] = round(time.monotonic() - began, 3)
        output = tail(agent.output)
        info = {
            "grader": {"verdict": grade.verdict, **grade.info},
            "grading": mode,
            "agent_exit_code": agent.exit_code,
            "agent_output": output,
            "diff": diff if len(diff) <= DIFF_KEPT else diff[:DIFF_KEPT] + "\n… (cut: the diff ran to more)\n",
        }
        for name, value in grade.rewards.items():
            await self._trainer.add_reward(episode_id, value, name, source="grader", info=info)
        reward = grade.reward
        done = functools.partial(Outcome, task, episode_id, diff=diff, agent_output=output, timings=timings)
        if agent.timed_out:
            return done("failed", reward, f"the agent ran past its budget of {self._agent_timeout_s(task):g} s")
        ended = grade.verdict
        if agent.exit_code != 0:
            said = _last_line(agent.output)
            ended = f"the agent exited with {agent.exit_code}" + (f": {said}" if said else "")
        if (over := await self._over_budget(episode_id)) is not None:  # the policy's attempt, cut short: trainable
            return done("finished", reward, f"{TRUNCATED}{over}; {ended}")
        return done("failed" if agent.exit_code != 0 else "finished", reward, ended)

    async def _over_budget(self, episode_id: str) -> str | None:
        """Why the episode's budget (turns, tokens, deadline) refused one of its agent's calls, if it did: asked of
        trajproxy only where the run gives its episodes a budget."""
        if not BUDGETS & self._config.episode.keys():
            return None
        return (await self._trainer.episode(episode_id)).over_budget

    async def _act(self, box: Sandbox, task: Task, episode_id: str, key: str) -> ExecResult:
        """Run the agent (or the task's own solution) to its end, its LLM calls answered by the policy."""
        timeout_s = self._agent_timeout_s(task)
        if self._config.oracle:
            if task.solver is None:
                raise SandboxError(f"task {task.where} has no solution for the oracle to run")
            return await task.solver.solve(box, timeout_s)
        serving = asyncio.create_task(self._policy.serve(self._trainer, episode_id))
        try:
            injected = self._config.agent
            if injected is None or injected.manifest.uses("task_file"):
                await box.upload(TASK_FILE, task.prompt.encode())
            if injected is not None:
                base, workdir = self._sandboxes.base_url, task.workdir or "."
                rendered = injected.render(base_url=base, key=key, task=task.prompt, workdir=workdir)
                return await box.exec(
                    launch_script(rendered), timeout_s=timeout_s, env=dict(rendered.env), user=rendered.user
                )
            command = self._config.agent_cmd.format(task_file=TASK_FILE, workdir=shlex.quote(task.workdir or "."))
            return await box.exec(command, timeout_s=timeout_s)
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)

    async def _diff(self, box: Sandbox, task: Task, *, needed: bool) -> str:
        """The agent's changes to the task's repository; when grading in place they are only a record, and a
        working directory that is not a git repository gives none."""
        diff = await box.exec(CAPTURE_DIFF, timeout_s=_GIT_S)
        if diff.ok:
            return diff.output
        if needed:
            raise SandboxError(f"could not capture the agent's changes with git in {task.workdir}: {diff.output}")
        return ""

    async def _grade_fresh(self, task: Task, episode_id: str, diff: str) -> Grade:
        """Apply the diff to a fresh container of the task's image (no network) and grade it there."""
        box = await self._sandboxes.start(self._spec(task, episode_id, env={}, proxy=False))
        try:
            await _set_up(box, task)
            if diff.strip():
                await box.upload(DIFF_FILE, diff.encode())
                applied = await box.exec(APPLY_DIFF, timeout_s=_GIT_S)
                if not applied.ok:
                    return Grade({"reward": 0.0}, "the diff does not apply", {"output": tail(applied.output)})
            return await task.grader.grade(box, self._grade_timeout_s(task))
        finally:
            await asyncio.shield(box.stop())

    def _agent_spec(self, task: Task, episode_id: str, key: str) -> SandboxSpec:
        base = self._sandboxes.base_url
        env = agent_env(base, key)
        agent = None if self._config.oracle else self._config.agent
        spec = self._spec(task, episode_id, env=env, proxy=True, agent=agent)
        if self._config.read_only if self._config.read_only is not None else task.read_only:
            root = ReadOnlyRoot(scratch=("/tmp", *task.scratch), scratch_bytes=self._config.scratch_bytes)
            spec = replace(spec, read_only=root)
        return spec

    def _agent_timeout_s(self, task: Task) -> float:
        return self._config.agent_timeout_s or task.agent_timeout_s or DEFAULT_AGENT_TIMEOUT_S

    def _grade_timeout_s(self, task: Task) -> float:
        return self._config.grade_timeout_s or task.grade_timeout_s or DEFAULT_GRADE_TIMEOUT_S

    def _deadline_s(self, task: Task) -> float:
        """The whole episode's, from its build to its grade: one stuck anywhere ends failed, its sandbox removed."""
        if given := self._config.episode_timeout_s:
            return given
        build_s = task.build_timeout_s if task.build is not None else 0.0
        return build_s + self._agent_timeout_s(task) + self._grade_timeout_s(task) + START_ALLOWANCE_S

    def _spec(
        self, task: Task, episode_id: str, *, env: dict[str, str], proxy: bool, agent: InjectedAgent | None = None
    ) -> SandboxSpec:
        return SandboxSpec(
            task.image,
            workdir=task.workdir,
            env=env,
            limits=self._config.limits or task.limits or Limits(),
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
        if outcome.lost:  # not an end yet: `run_many` runs the task again
            return
        self._count(**{outcome.status: 1})  # finished, failed or cancelled
        if outcome.reward is not None:
            self.progress.rewards.append(outcome.reward)
            self._on_change(self.progress)

    def _count(self, **changes: int) -> None:
        for name, change in changes.items():
            setattr(self.progress, name, getattr(self.progress, name) + change)
        self._on_change(self.progress)


async def _set_up(box: Sandbox, task: Task) -> None:
    """Run the task's setup, if it has one, where the agent will work and where its diff is graded: both start
    from the same state, so the diff applies."""
    if task.setup:
        done = await box.exec(f"bash -ec {shlex.quote(task.setup)}", timeout_s=SETUP_TIMEOUT_S)
        if not done.ok:
            said = _last_line(done.output)
            raise SandboxError(f"the task's setup failed (exit {done.exit_code})" + (f": {said}" if said else ""))


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
