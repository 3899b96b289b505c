"""The broker: agents' calls become parked turns, trainers pull and answer them, every step is recorded.

Promises kept here: a turn is committed to the store before any trainer can see it, and a reply is
committed before its agent receives it; what the broker holds in memory about an episode (its next seq, its
branches, its status) changes only once the store has accepted the change. Cleanup of an open turn (answer,
timeout, agent gone, episode finished) always goes through the ledger's `close`, which settles the turn in
the parking lot exactly once. A restart loses no turn: `recover` takes back the open turns the store holds,
for their agents' retries to claim. Given a shared queue (replicas sharing one database), the queue is the
database's: pulls and answers go there (`shared_turns`), and `Replicas` keeps this replica in step with the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from proxy.core.answers import Answer, Answers
from proxy.core.deadlines import Deadlines
from proxy.core.episodes import LiveEpisode, LiveEpisodes, closed_error
from proxy.core.errors import BadRequest, Conflict, EpisodeClosed, NotFound, OverBudget, TrajproxyError, Unauthorized
from proxy.core.forks import Forks
from proxy.core.keys import hash_key, new_id, new_key, same_secret
from proxy.core.ledger import Ledger
from proxy.core.observer import Observer
from proxy.core.parking import ParkingLot, Slot
from proxy.core.pause import Pause
from proxy.core.ports import SharedQueue, Store, TokenCounter, Upstream
from proxy.core.pulls import Pulls
from proxy.core.recording import Recorder
from proxy.core.recovery import adopt, left_open
from proxy.core.replicas import Replicas
from proxy.core.retries import retried
from proxy.core.rewards import Rewards
from proxy.core.shared_turns import Bell, SharedAnswers, SharedPulls
from proxy.core.values import (
    Budget,
    Episode,
    EpisodeStatus,
    JsonObject,
    ModelRoute,
    Reply,
    Reward,
    Tally,
    Turn,
    TurnStatus,
)
from proxy.core.weights import WeightSync

log = logging.getLogger("trajproxy")


class Broker:
    def __init__(
        self,
        store: Store,
        tokens: TokenCounter,
        upstream: Upstream,
        *,
        turn_timeout_s: float,
        lease_s: float,
        retry_grace_s: float = 5.0,
        restart_grace_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        observer: Observer | None = None,  # told of each change of state (metrics)
        shared: SharedQueue | None = None,  # the queue of replicas sharing one database (shared mode)
    ) -> None:
        self._store = store
        self._tokens = tokens
        self._lease_s = lease_s
        self._now = clock
        self._lot = ParkingLot(on_lease_expired=self._lease_expired)
        self._ledger = Ledger(self._lot, store, clock, observer)
        self._episodes = LiveEpisodes(store)
        self._bell = bell = Bell()
        answering = (self._lot, self._ledger, store, tokens, upstream, self._episodes, clock)
        pulling = (self._lot, self._ledger, store, self._episodes, self.episode, clock)
        self._answers: Answers = Answers(*answering, lease_s=lease_s)
        self._pulls: Pulls = Pulls(*pulling, lease_s=lease_s)
        if shared is not None:
            self._answers = SharedAnswers(*answering, lease_s=lease_s, queue=shared)
            self._pulls = SharedPulls(*pulling, lease_s=lease_s, queue=shared, bell=bell)
        self._forks = Forks(self._lot, self._ledger, store, self._answers, clock)
        self._rewards = Rewards(store, self._ledger, self.episode, clock)
        self._recorder = Recorder(store, self._episodes, clock, self._over_budget, shared)
        self._deadlines = Deadlines(
            self._lot,
            self._ledger,
            store,
            turn_timeout_s=turn_timeout_s,
            retry_grace_s=retry_grace_s,
            restart_grace_s=restart_grace_s,
        )
        self._pause = Pause(self._lot, self._answers.by_model)
        self._shared = shared
        self._replicas = None
        if shared is not None:
            parts = (self._episodes, self._answers, self._deadlines, self._pause, bell, clock)
            self._replicas = Replicas(shared, self._lot, self._ledger, store, *parts, lease_s=lease_s)
        self.weights = WeightSync(self._pause, self._answers, self._replicas)  # the trainer's weight-update cycle

    @property
    def open_turns(self) -> int:
        return len(self._lot)

    @property
    def ready_turns(self) -> int:
        return self._lot.ready_count

    @property
    def leased_turns(self) -> int:
        return self._lot.leased_count

    @property
    def waiting_pollers(self) -> int:
        return self._lot.poller_count + self._bell.waiting

    def queue(self, limit: int) -> list[Turn]:
        """Up to `limit` open turns (parked or leased) as they stand now, oldest first."""
        return self._lot.turns(limit)

    async def drain(self) -> None:
        """Wait for the background writes submitted so far (state changes nobody awaited) to be committed."""
        await self._ledger.drain()

    async def recover(self) -> int:
        """Take back the open turns a previous process left in the store (it stopped or crashed holding them);
        call once, at start-up, before serving. Returns how many it took back.

        Their agents' connections died with that process, so each waits out of the queue, as a turn whose agent
        hung up does: its agent's SDK retry (the same body) reattaches to it within the restart grace (longer
        than the retry grace: an SDK deep in its backoff comes back late), or it is recorded abandoned. A leased
        one keeps its lease (renewed), so the reply its trainer sends still lands; answered before the retry
        comes, it is replayed to the retry. A turn a model answers goes to it again.

        A replica sharing the database takes back only what no live replica holds (see `Replicas`).
        """
        if self._replicas is not None:
            return await self._replicas.start()
        left = await left_open(self._store, self._episodes, self._now())
        for slot, answerer in adopt(left, self._lot, self._lease_s):
            self._deadlines.after_restart(slot)
            if answerer is not None:  # a model answers it: it goes to the model again
                self._answers.by_model(slot, answerer)
        await self._store.save_turns(left.closed)
        if left.episodes:
            log.info("took back %d open turns of %d episodes from the store", len(left.waiting), left.episodes)
        return len(left.waiting)

    async def stop(self) -> None:
        """Leave the replicas sharing the database (the others take over what this one holds); call at the end."""
        if self._replicas is not None:
            await self._replicas.stop()

    # Episodes

    async def create_episode(
        self,
        task: str,
        metadata: JsonObject,
        turn_timeout_s: float | None = None,
        *,
        policy: ModelRoute | None = None,
        routes: Sequence[ModelRoute] = (),
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
        self._lot.wake(episode_id)  # a trainer stepping through this episode learns it has ended
        why = f"episode {episode_id} is {status}" + (f": {reason}" if reason else "")
        if self._shared is not None:  # its open turns on every replica
            await self._shared.episode_closed(episode_id, why, self._now())
        slots = self._lot.of_episode(episode_id)
        closed = [turn for slot in slots if (turn := self._ledger.close(slot, TurnStatus.FAILED, why))]
        try:
            await self._store.save_turns(closed)
        finally:
            for slot in slots:
                slot.fail(EpisodeClosed(why))
        return episode

    # Agent side

    async def park(
        self, episode_id: str, dialect: str, request: JsonObject, wire: bytes, *, stream: bool, retry: bool = False
    ) -> Slot:
        """Record the agent's call as a new turn and park it for a trainer to pull.

        An SDK's retry (`retry`) of a call whose turn is still open attaches to that turn, and a retry of the
        episode's last answered call gets its recorded reply again: a retry never becomes a second turn.
        """
        live = await self._episodes.load(episode_id)
        if live is None:
            raise closed_error(await self.episode(episode_id))
        if retry and (same := await self._retried(live, wire)) is not None:
            return same
        # A fork's first calls are answered from its parent's (the check costs nothing for other episodes).
        replay = await self._forks.replay(live) if "fork" in live.episode.metadata else None
        self._pause.refuse_if_rejecting()
        live.restore_arguments(request)
        route = live.route(request)
        held_for = "model" if route or live.episode.policy else "pause" if self._pause.mode == "hold" else None
        recorded = asyncio.get_running_loop().create_future()
        live.recording[recorded] = wire
        try:
            turn = await self._recorder.record(
                live, dialect, request, wire, stream=stream, trainable=route is None, held_for=held_for
            )
        finally:  # a retry of this call that came meanwhile finds the turn in the lot once it resumes
            del live.recording[recorded]
            recorded.set_result(None)
        self._ledger.observer.recorded(turn)
        if live.episode.status.closed:
            failed = replace(turn, status=TurnStatus.FAILED, ended_at=self._now(), reason="episode closed")
            self._ledger.submit(self._store.save_turns([failed]))
            self._ledger.observer.settled(failed)
            raise closed_error(live.episode)
        slot = self._lot.park(turn)
        if self._replicas is not None:  # a trainer elsewhere may have answered it already
            self._replicas.parked(slot)
        if replay is not None and await self._forks.take(live, replay, slot):
            return slot
        answerer = route or live.episode.policy  # None: a trainer answers
        if (answerer is None or answerer.served) and self._pause.hold_if_holding(slot, turn.created_at, answerer):
            return slot  # the policy being trained waits out the pause
        if answerer is not None:  # a model answers: no trainer sees the turn
            self._answers.by_model(slot, answerer, since=turn.created_at)
        return slot

    async def _retried(self, live: LiveEpisode, wire: bytes) -> Slot | None:
        """The turn an SDK retry belongs to (see `retried`); with replicas, wherever its first attempt landed."""
        same = await retried(self._lot, self._store, live, wire)
        return same if self._replicas is None else await self._replicas.retried(same, live, wire)

    async def _over_budget(self, live: LiveEpisode, why: str) -> None:
        """Refuse a call over the episode's budget (429), or finish the episode if its budget says so (410)."""
        episode = live.episode
        if episode.budget.finish:
            await self.finish(episode.id, EpisodeStatus.FINISHED, why, over_budget=why)
            raise closed_error(await self.episode(episode.id))
        await self._episodes.flag(live, why)
        raise OverBudget(f"episode {episode.id} is {why}; it takes no more calls")

    def expire_later(self, slot: Slot, episode: Episode) -> asyncio.TimerHandle:
        """Start the turn timeout of an agent exchange waiting on `slot.answer` (see `Deadlines`)."""
        return self._deadlines.expire_later(slot, episode)

    def leave(self, slot: Slot) -> None:
        """An agent exchange ended: its turn waits for a retry within the retry grace (see `Deadlines`)."""
        self._deadlines.leave(slot)
        if self._replicas is not None and slot.withdrawn:
            self._replicas.away(slot, True)

    def delivered(self, turn: Turn) -> None:
        """An answered turn's reply was handed to its agent's connection."""
        self._ledger.observer.delivered(turn, self._now())

    def count_tokens(self, request: JsonObject) -> int:
        """The prompt tokens of a chat request, as replies count them (for count_tokens endpoints)."""
        return self._tokens.count_prompt(request)

    # Trainer side

    async def pull(self, episode_id: str | None, max_turns: int, wait_s: float, lease_s: float | None) -> list[Turn]:
        """Lease up to `max_turns` parked turns, waiting up to `wait_s` for the first one (see `Pulls`)."""
        return await self._pulls.pull(episode_id, max_turns, wait_s, lease_s)

    def release(self, turns: Sequence[Turn]) -> None:
        """Give back leased turns whose poller went away before receiving them."""
        self._pulls.release(turns)

    async def next_turn(self, episode_id: str, wait_s: float, lease_s: float | None) -> Turn | None:
        """Lease the episode's next turn, waiting up to `wait_s` for its agent to call (see `Pulls`)."""
        return await self._pulls.next_turn(episode_id, wait_s, lease_s)

    async def reply(self, turn_id: str, reply: Reply, lease_id: str | None = None) -> Turn:
        """Answer a turn. The same reply again succeeds; a different one is a conflict."""
        return await self._answers.reply(turn_id, reply, lease_id)

    async def reply_all(self, answers: Sequence[Answer]) -> list[Turn | TrajproxyError]:
        """Answer many turns (`reply` for each), recording them in one write; each succeeds or fails alone."""
        return await self._answers.reply_all(answers)

    async def forward(self, turn_id: str, route: ModelRoute, lease_id: str | None, lease_s: float | None) -> Turn:
        """Answer a turn from a model instead of the trainer; the turn stays leased while the model works."""
        return await self._answers.forward(turn_id, route, lease_id, lease_s)

    async def add_reward(self, episode_id: str, name: str, value: float, **details: Any) -> Reward:
        """Record a reward of the episode (or of one of its turns: `turn_id`); see `Rewards.add`."""
        return await self._rewards.add(episode_id, name, value, **details)

    async def turn(self, turn_id: str) -> Turn:
        if self._shared is not None and self._lot.get(turn_id) is not None:  # open: its lease is the database's
            return (await self._shared.turns([turn_id]))[turn_id]
        return await self._ledger.turn(turn_id)

    async def rewards(self, episode_id: str) -> list[Reward]:
        await self.episode(episode_id)
        return await self._store.rewards(episode_id)

    async def trajectory(self, episode_id: str) -> tuple[Episode, list[Turn], list[Reward]]:
        episode = await self.episode(episode_id)
        await self.drain()
        turns, rewards = await asyncio.gather(self._store.turns(episode_id), self._store.rewards(episode_id))
        return episode, turns, rewards

    # Internals

    def _lease_expired(self, slot: Slot) -> None:
        log.info("lease on turn %s expired; it is back in the queue", slot.turn.id)
