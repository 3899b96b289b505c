"""The broker: agents' calls become parked turns, trainers pull and answer them, every step is recorded.

Promises kept here: a turn is committed to the store before any trainer can see it, and a reply is
committed before its agent receives it; what the broker holds in memory about an episode (its next seq, its
branches, its status) changes only once the store has accepted the change. Every end of an open turn (answer,
failure, timeout, agent gone, episode finished) goes through `Endings.settle`: out of the open turns exactly
once, recorded, then its agent and the observers told, even when the record fails. Where open turns are leased
and answered is the queue's business (`TurnQueue`: this process's open turns, or the database replicas share); the
broker never asks which queue it has. Where replicas share the database it is given `Others` too, and tells them
what they must hear (a turn parked here, its agent gone, an episode closed); with none, there is nobody to tell.

A parked call's whole life reads here: `park` records and parks it (or hands it to a model, a fork's replay,
the pause), `attend` holds its agent's exchange on it until the answer, the turn timeout or a hang-up (then
the retry grace), and every exit lets go of the turn.

Recording an agent's call as its episode's next turn: one at a time per episode, and the episode takes the
turn's seq and branch only once the store has the turn, so a failed write leaves no gap in its seqs and no branch
head behind. Where other replicas share the database one of them may have recorded the episode's next turn first:
the write is refused as stale, the episode is read again, and the call recorded after it. With no others, a write
refused as stale is refused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from proxy.core.answers import Answers
from proxy.core.chunks import Body
from proxy.core.context import Context
from proxy.core.endings import Attendance
from proxy.core.episodes import LiveEpisode, closed_error
from proxy.core.errors import BadRequest, Conflict, EpisodeClosed, NotFound, NoTurnYet, OverBudget, Unauthorized
from proxy.core.forks import Forks
from proxy.core.open_turns import HOLDING, OpenTurn, Pause
from proxy.core.queue import Others, TurnQueue
from proxy.core.recorder import Recorder
from proxy.core.retries import orphaned
from proxy.core.rewards import Rewards
from proxy.core.values import (
    Answerer,
    Budget,
    Episode,
    EpisodeStatus,
    Extension,
    JsonObject,
    Reward,
    Tally,
    Turn,
    TurnStatus,
    hash_key,
    new_id,
    new_key,
    same_secret,
)
from proxy.core.weights import WeightSync

TurnPages = Callable[[int, int], Awaitable[list[Turn]]]  # (after seq, at most) -> an episode's next turns

log = logging.getLogger("trajproxy")


class Broker:
    def __init__(self, *, context: Context, queue: TurnQueue, others: Others | None = None) -> None:
        self._context = context
        self._store = context.store
        self._now = context.clock
        self._open_turns = context.open_turns
        self._endings = context.endings
        self._episodes = context.episodes
        self.queue = queue  # pulls, releases and the queue's state
        self._others = others  # the replicas sharing the database, if any
        self.answers: Answers = queue.answers  # replies to turns, from trainers or models
        self._forks = Forks(context=context, answers=self.answers)
        self.rewards = Rewards(context=context, episode=self.episode)
        self._recorder = Recorder(
            context=context, queue=queue, others=others, over_budget=self._over_budget, stale=self._stale
        )
        self._pause = Pause(context.open_turns, self.answers.by_model)
        self.weights = WeightSync(pause=self._pause, answers=self.answers, others=others)  # the weight-update cycle

    @property
    def open_turns(self) -> int:
        return len(self._open_turns)

    @property
    def ready_turns(self) -> int:
        return self._open_turns.ready_count

    @property
    def leased_turns(self) -> int:
        return self._open_turns.leased_count

    def open(self, limit: int) -> list[Turn]:
        """Up to `limit` open turns (parked or leased) as they stand now, oldest first."""
        return self._open_turns.turns(limit)

    async def drain(self) -> None:
        """Wait for the background writes submitted so far (state changes nobody awaited) to be committed; not for
        the models answering turns."""
        await self._endings.drain()

    async def wind_down(self) -> None:
        """Wait for the models answering turns, and every write (at shutdown)."""
        await self._endings.wind_down()

    async def start(self) -> int:
        """Take back the open turns a stopped process left (see `TurnQueue.start`); call once, before serving."""
        return await self.queue.start(self._pause)

    async def stop(self) -> None:
        """Leave the replicas sharing the database, if any (the others take over what this one holds)."""
        if self._others is not None:
            await self._others.stop()

    # Episodes

    async def create_episode(
        self,
        task: str,
        metadata: JsonObject,
        turn_timeout_s: float | None = None,
        *,
        policy: Answerer | None = None,
        routes: Sequence[Answerer] = (),
        budget: Budget | None = None,
        deadline_s: float | None = None,
    ) -> tuple[Episode, str]:
        """Record a new episode; returns it with its key, which is never stored in the clear.

        `deadline_s` (seconds from now) sets the budget's deadline."""
        key = new_key()
        now = self._now()
        budget = budget or Budget()
        if deadline_s is not None:
            budget = replace(budget, deadline_at=now + deadline_s)
        episode = Episode(
            id=new_id("ep"),
            key_hash=hash_key(key),
            task=task,
            metadata=metadata,
            status=EpisodeStatus.PENDING,
            created_at=now,
            turn_timeout_s=turn_timeout_s,
            policy=policy,
            routes=tuple(routes),
            budget=budget,
        )
        await self._store.add_episode(episode)
        self._episodes.add(episode, Tally())
        return episode, key

    async def fork(self, parent_id: str, at_turn: int, n: int, **options: Any) -> list[tuple[Episode, str]]:
        """n new episodes on the parent's task, each replaying its first `at_turn` calls (see `Forks.make` for
        the options: policy, inherit_policy, ignore, min_similarity, on_divergence)."""
        return await self._forks.make(await self.episode(parent_id), at_turn, n, self.create_episode, **options)

    async def authenticate(self, key: str | None) -> Episode:
        if not key:
            raise Unauthorized(
                "missing episode key: send it as 'Authorization: Bearer <key>', as 'x-api-key: <key>', "
                "or in the path as /e/<key>/v1/..."
            )
        key_hash = hash_key(key)
        live = self._episodes.by_key_hash(key_hash)
        episode = live.episode if live else await self._store.episode_by_key_hash(key_hash)
        if episode is None or not same_secret(episode.key_hash, key_hash):
            raise Unauthorized("unknown episode key: create an episode with POST /api/episodes and use its key")
        if live is None and not episode.status.closed:
            await self._episodes.load(episode.id)
        return episode

    def live(self, episode_id: str) -> LiveEpisode | None:
        """The live state of an open episode this process serves, if it holds it."""
        return self._episodes.get(episode_id)

    async def episode(self, episode_id: str) -> Episode:
        live = self._episodes.get(episode_id)
        known = live.episode if live else self._episodes.closed(episode_id)
        episode = known or await self._store.episode(episode_id)
        if episode is None:
            raise NotFound(f"no episode {episode_id!r}")
        return episode

    async def episodes(self, status: EpisodeStatus | None, limit: int, offset: int) -> list[Episode]:
        return await self._store.episodes(status, limit, offset)

    async def finish(
        self, episode_id: str, status: EpisodeStatus, reason: str | None, *, over_budget: str | None = None
    ) -> Episode:
        """Close an episode; its open turns fail and their agents get an 'episode closed' error."""
        if not status.closed:
            raise BadRequest(f"an episode can only be finished as finished, failed or cancelled, not {status}")
        live = await self._episodes.load(episode_id)
        episode = await self._episodes.close(live, status, reason, self._now(), over_budget) if live else None
        if episode is None:
            episode = await self.episode(episode_id)
            if episode.status is status:
                return episode
            raise Conflict(f"episode {episode_id} is already {episode.status}; it cannot become {status}")
        self._open_turns.wake(episode_id)  # a trainer stepping through this episode learns it has ended
        why = f"episode {episode_id} is {status}" + (f": {reason}" if reason else "")
        # Its agents here hear it once their turns' ends are recorded, or have failed to be: then so does the trainer.
        recorded = self._endings.end(
            self._open_turns.of_episode(episode_id), TurnStatus.FAILED, why, EpisodeClosed(why)
        )
        if self._others is not None:  # its open turns held elsewhere
            await self._others.closed(episode_id, why)
        await recorded
        return episode

    # Agent side

    async def park(
        self,
        episode_id: str,
        dialect: str,
        request: JsonObject,
        wire: Body,
        *,
        stream: bool,
        retry: bool | None = False,
        extension: Extension | None = None,
    ) -> OpenTurn:
        """Record the agent's call as a new turn and park it for a trainer to pull.

        An SDK's retry (`retry`) of a call whose turn is still open attaches to that turn, and a retry of the
        episode's last answered call gets its recorded reply again: a retry never becomes a second turn. A call
        that does not say whether it is one (`retry` None) is one by its body (`proxy.core.retries`). A call whose
        request extends an earlier one's (`extension`) has only its new messages looked at where that suffices.
        """
        live = await self._episodes.load(episode_id)
        if live is None:
            raise closed_error(await self.episode(episode_id))
        if retry or orphaned(self._context.open_turns, episode_id, wire):
            if (same := await self.queue.retried(live, wire)) is not None:
                return same
        elif retry is None and (same := await self.queue.unmarked_retry(live, wire)) is not None:
            return same
        # A fork's first calls are answered from its parent's (the check costs nothing for other episodes).
        replay = await self._forks.replay(live) if "fork" in live.episode.metadata else None
        self._pause.refuse_if_rejecting()
        if live.restore_arguments(request, extension):
            extension = None  # an earlier message's arguments were given back: its pieces are not the earlier ones
        side = live.side_answerer(request)
        answerer = side or live.episode.policy  # None: a trainer answers
        held_for = "model" if answerer else "pause" if self._pause.mode in HOLDING else None
        recorded = asyncio.get_running_loop().create_future()
        live.recording[recorded] = wire
        try:
            turn = await self._recorder.record(
                live,
                dialect,
                request,
                wire,
                stream=stream,
                trainable=side is None,
                held_for=held_for,
                extension=extension,
            )
        finally:  # a retry of this call that came meanwhile finds the turn open once it resumes
            del live.recording[recorded]
            recorded.set_result(None)
        self._endings.observer.recorded(turn)
        open_turn = self._open_turns.park(turn)
        if live.episode.status.closed:  # it closed while the turn was written: the turn ends as it began
            self._endings.end([open_turn], TurnStatus.FAILED, "episode closed", closed_error(live.episode))
            return open_turn
        if self._others is not None:
            self._others.parked(open_turn)
        if replay is not None and await self._forks.take(live, replay, open_turn):
            return open_turn
        if (answerer is None or answerer.served) and self._pause.hold_if_holding(open_turn, turn.created_at, answerer):
            return open_turn  # the policy being trained waits out the pause
        if answerer is not None:  # a model answers: no trainer sees the turn
            self.answers.by_model(open_turn, answerer, since=turn.created_at)
        return open_turn

    async def _over_budget(self, live: LiveEpisode, why: str) -> None:
        """Refuse a call over the episode's budget (429), or finish the episode if its budget says so (410)."""
        episode = live.episode
        if episode.budget.finish:
            await self.finish(episode.id, EpisodeStatus.FINISHED, why, over_budget=why)
            raise closed_error(await self.episode(episode.id))
        await self._episodes.flag(live, why)
        raise OverBudget(f"episode {episode.id} is {why}; it takes no more calls")

    async def _stale(self, live: LiveEpisode, why: str) -> None:
        """End an episode whose next call would take it past its `max_staleness`: finished, or failed (what trainers
        drop as an infrastructure failure) if it says so."""
        episode = live.episode
        status = EpisodeStatus.FAILED if episode.budget.stale_fails else EpisodeStatus.FINISHED
        await self.finish(episode.id, status, why)
        raise closed_error(await self.episode(episode.id))

    def attend(self, open_turn: OpenTurn, episode: Episode) -> Attendance:
        """Hold an agent's exchange on its parked turn (`with broker.attend(...) as answer`): the answer it waits
        for. If no reply comes within the turn timeout, the turn is recorded expired and the agent hears so. However
        the exchange ends (reply, error, timeout, hang-up, the server stopping), leaving lets go of the turn: if it
        was the turn's last exchange and the turn is unanswered, the turn leaves the queue and waits the retry grace
        for its SDK's retry, then is recorded abandoned (see `Deadlines`)."""
        away = self._others.away if self._others is not None else None
        return Attendance(open_turn, episode, self._context.deadlines, away)

    def handed_over(self, turn: Turn) -> None:
        """An answered turn's reply was handed over to its agent's connection."""
        if (live := self._episodes.get(turn.episode_id)) is not None:
            live.handed(turn)
        self._endings.observer.handed_over(turn, self._now())

    def count_tokens(self, request: JsonObject) -> int:
        """The prompt tokens of a chat request, as replies count them (for count_tokens endpoints)."""
        return self._context.tokens.count_prompt(request)

    # Trainer side

    async def next_turn(self, episode_id: str, wait_s: float, lease_s: float | None) -> Turn | None:
        """Lease the episode's next turn, waiting up to `wait_s` for its agent to call; None once the episode
        has ended with nothing left to answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not (turns := await self.queue.pull(episode_id, 1, max(0.0, deadline - loop.time()), lease_s)):
            if (await self.episode(episode_id)).status.closed:
                return None
            if loop.time() >= deadline:
                raise NoTurnYet(
                    f"episode {episode_id}'s agent made no call within {wait_s:g} s and is still running; "
                    "ask again to keep waiting"
                )
        return turns[0]

    async def trajectory(self, episode_id: str) -> tuple[Episode, list[Turn], list[Reward]]:
        episode = await self.episode(episode_id)
        await self.drain()
        turns, rewards = await asyncio.gather(self._store.turns(episode_id), self._store.rewards(episode_id))
        return episode, turns, rewards

    async def trajectory_pages(self, episode_id: str) -> tuple[Episode, list[Reward], TurnPages]:
        """A trajectory whose turns are read a page at a time, as they are handed on: a long episode is never all
        in memory at once. The pages read what is recorded by the time each is read."""
        episode = await self.episode(episode_id)
        await self.drain()
        rewards = await self._store.rewards(episode_id)
        return episode, rewards, partial(self._store.turns_after, episode_id)
