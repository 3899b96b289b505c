"""The dm_env view of a task: an agent working on it in a sandbox is the environment, its LLM calls the
observations, the policy's replies the actions, the grade the reward.

async with AgentEnv(trainer, sandboxes, task, RunConfig(agent=inject("minimal"))) as env:
    step = await env.reset()                    # FIRST: the agent's first LLM request, in chat shape
    while not step.last():
        step = await env.step(policy(step.observation))   # MID: its next request
    print(step.reward)                          # LAST: the graded episode's reward

Many run side by side with `asyncio.gather`. The TimeSteps are the REST view's (POST /api/episodes/{id}/reset
and /step), so a trainer in another language sees exactly the same thing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Self

from proxy import schema
from proxy.client import AsyncTrainerClient, TrajproxyAPIError
from sandbox.backends.interface import Sandboxes
from sandbox.run.policies import TrainerPolicy
from sandbox.run.runner import Outcome, RunConfig, Runner
from sandbox.tasks.task import Task

Action = str | dict[str, Any]  # the reply's text, or a chat message ({"content": ..., "tool_calls": [...]})

_POLL_S = 30.0  # each wait for the agent's next call; between waits, a failed run is noticed


class AgentEnv:
    def __init__(self, trainer: AsyncTrainerClient, sandboxes: Sandboxes, task: Task, config: RunConfig) -> None:
        self._trainer = trainer
        self._task = task
        self._runner = Runner(trainer, sandboxes, TrainerPolicy(), config)
        self._run: asyncio.Task[Outcome] | None = None
        self.episode: schema.EpisodeCreated | None = None
        self.outcome: Outcome | None = None  # once the run is over: status, reward, the agent's diff
        self._ended = False

    async def __aenter__(self) -> Self:
        """Create the episode and start the agent in its sandbox."""
        self.episode = await self._runner.open(self._task)
        self._run = asyncio.create_task(self._runner.run(self._task, self.episode))
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        """After LAST, wait for the run to wrap up; leaving before LAST cancels the run and its episode."""
        if self._run is None:
            return
        if not self._ended:
            self._run.cancel()
        try:
            self.outcome = await self._run
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():  # we are being cancelled ourselves
                raise

    async def reset(self) -> schema.TimeStep:
        """The FIRST TimeStep: the agent's first LLM request (or LAST, if it ended without one)."""
        return await self._patiently(lambda episode_id: self._trainer.reset(episode_id, wait_s=_POLL_S))

    async def step(self, action: Action) -> schema.TimeStep:
        """Answer the agent's current request; the next TimeStep is its next request (MID), or, once it has
        finished and been graded, LAST with the episode's reward."""
        message = {"content": action} if isinstance(action, str) else action
        return await self._patiently(lambda episode_id: self._trainer.step(episode_id, message=message, wait_s=_POLL_S))

    async def _patiently(self, call: Callable[[str], Awaitable[schema.TimeStep]]) -> schema.TimeStep:
        """Send a reset or step until the agent has called or ended (sending it again is safe)."""
        if self.episode is None or self._run is None:
            raise RuntimeError("the environment is not started: use it as `async with AgentEnv(...) as env`")
        while True:
            try:
                step = await call(self.episode.id)
            except TrajproxyAPIError as e:
                if e.kind != "no_turn_yet":
                    raise
            else:
                self._ended = step.last()
                return step
            if self._run.done():  # the run ended without closing its episode: something broke
                self._run.result()
                raise RuntimeError(f"the run of episode {self.episode.id} ended, but its episode is still open")
