"""The dm_env view of an episode: `reset` leases the agent's first call, `step` answers the current call
and leases the next, until the agent has finished and been graded.

Observations are the agent's LLM requests in chat shape; actions are replies. Rewards arrive at the end:
the LAST step carries the episode's return: its episode-level reward named `reward` (the grader's, usually),
else the sum of its episode-level rewards, 0 with none (`values.episode_return`).
Its discount is 0 when the episode ended on its own and 1 when a budget cut it short (a truncation,
as dm_env has it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from proxy.core.broker import Broker
from proxy.core.errors import Conflict
from proxy.core.values import Episode, Reply, Reward, Turn, episode_return, episode_rewards


class StepType(IntEnum):
    """dm_env's step types, with its values."""

    FIRST = 0
    MID = 1
    LAST = 2


@dataclass(frozen=True, slots=True)
class TimeStep:
    step_type: StepType
    observation: Turn | None  # the call to answer next; None on the LAST step
    reward: float | None  # None on FIRST, 0 on MID, the episode's return on LAST
    discount: float | None  # None on FIRST, 1 on MID
    episode: Episode
    rewards: tuple[Reward, ...] = ()  # on LAST: the episode-level rewards making up the return


class Steps:
    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self._current: dict[str, str] = {}  # episode id -> the turn its last reset or step handed out
        self._answered: dict[str, str] = {}  # episode id -> the turn its last step answered

    async def reset(self, episode_id: str, wait_s: float, lease_s: float | None) -> TimeStep:
        """The FIRST step: the agent's first call (or LAST at once, if the agent ended without calling)."""
        if episode_id in self._current:
            raise Conflict(
                f"episode {episode_id} has been reset already and is under way; go on with step, "
                "or create a new episode for a new attempt"
            )
        return await self._next(episode_id, wait_s, lease_s, first=True)

    def current(self, episode_id: str) -> str:
        """The call the episode's last reset or step handed out, which its next step answers."""
        turn_id = self._current.get(episode_id)
        if turn_id is None:
            raise Conflict(f"episode {episode_id} has no call to answer: reset it first (or name the turn_id)")
        return turn_id

    def undo(self, step: TimeStep) -> None:
        """Give back the call a step leased for a trainer that hung up before receiving it."""
        if step.observation is not None:
            episode_id = step.episode.id
            self._broker.queue.release([step.observation])
            if (answered := self._answered.get(episode_id)) is not None:
                self._current[episode_id] = answered  # the same step sent again goes on from there
            else:
                self._current.pop(episode_id, None)  # the reset may be sent again

    async def step(
        self, episode_id: str, turn_id: str, action: Reply, wait_s: float, lease_s: float | None
    ) -> TimeStep:
        """Answer the call `turn_id` with `action`, then wait for the agent's next call."""
        turn = await self._broker.queue.turn(turn_id)
        if turn.episode_id != episode_id:
            raise Conflict(f"turn {turn_id} belongs to another episode")
        await self._broker.answers.reply(turn_id, action)  # idempotent: a step sent again answers nothing twice
        self._answered[episode_id] = turn_id
        return await self._next(episode_id, wait_s, lease_s, first=False)

    async def _next(self, episode_id: str, wait_s: float, lease_s: float | None, *, first: bool) -> TimeStep:
        turn = await self._broker.next_turn(episode_id, wait_s, lease_s)
        if turn is not None:
            self._current[episode_id] = turn.id
            episode = await self._broker.episode(episode_id)
            if first:
                return TimeStep(StepType.FIRST, turn, None, None, episode)
            return TimeStep(StepType.MID, turn, 0.0, 1.0, episode)
        self._current.pop(episode_id, None)
        self._answered.pop(episode_id, None)
        episode = await self._broker.episode(episode_id)
        ending = tuple(reward for reward in await self._broker.rewards.of(episode_id) if reward.turn_id is None)
        discount = 1.0 if episode.over_budget else 0.0
        returned = episode_return(episode_rewards(ending))
        return TimeStep(StepType.LAST, None, 0.0 if returned is None else returned, discount, episode, ending)
