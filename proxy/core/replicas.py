"""Replicas sharing one database (shared mode): this replica's part in the fleet.

It says it is alive every `heartbeat_s`; when another stops saying so (killed, or cut off), one live replica takes
over its open turns: they stay pullable and answerable, their agents' SDK retries (through the load balancer, to
any replica) attach to them, and one whose agent never comes back is abandoned after the restart grace, as after a
restart. It hears what the others did: turns parked (waiting pulls wake), a turn of its own answered (its agent gets
the reply the database holds), an episode closed (its agents hear so), the pause changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace

from proxy.core.answers import Answers
from proxy.core.chunks import Body
from proxy.core.context import Context
from proxy.core.episodes import LiveEpisode, closed_error
from proxy.core.errors import StorageError
from proxy.core.open_turns import OpenTurn, Pause, Pollers
from proxy.core.ports import SharedDatabase
from proxy.core.retries import replayed, unsent
from proxy.core.values import Turn, TurnStatus

log = logging.getLogger("trajproxy")

_EARLY_KEPT = 65536  # answers heard for turns not held here (most are other replicas'), the latest kept


class Replicas:
    def __init__(self, *, context: Context, database: SharedDatabase, answers: Answers, pollers: Pollers) -> None:
        self._database = database
        self._open_turns = context.open_turns
        self._endings = context.endings
        self._store = context.store
        self._episodes = context.episodes
        self._answers = answers
        self._deadlines = context.deadlines
        self._pause: Pause | None = None  # the broker's, from `start`
        self._pollers = pollers
        self._now = context.clock
        self._lease_s = context.lease_s
        self._beating: asyncio.Task[None] | None = None
        self._in_order: asyncio.Future[None] | None = None  # the last of the changes made in the order asked
        self._answered: set[str] = set()  # turns held here answered elsewhere, to be read at the next tick
        # Turns heard answered before this replica held them: a trainer may pull and answer a turn between its
        # insert's commit and its turn being parked here (the agent's call resumes a moment later).
        self._early: OrderedDict[str, None] = OrderedDict()

    async def start(self, pause: Pause) -> int:
        """Join: hear the others, obey the pause, take over what dead replicas left. Returns how many turns."""
        self._pause = pause
        await self._database.start(self._heard)
        await self._obey_pause()
        taken = await self._take_over()
        self._beating = asyncio.create_task(self._beat(), name="trajproxy-heartbeat")
        return taken

    async def stop(self) -> None:
        if self._beating is not None:
            self._beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beating
        await self._database.stop()

    async def retried(self, found: OpenTurn | None, live: LiveEpisode, wire: Body) -> OpenTurn | None:
        """An SDK retry, with the turn this replica found for it (see `retries`): back in every replica's queue if
        its agent had hung up; if this replica found none, the turn its first attempt made on another, open or (a
        trainer answered it since this replica looked) answered."""
        if found is None:
            return await self.attach(live, wire) or await replayed(self._store, live, wire)
        self.away(found, False)
        return found

    async def unmarked_retry(self, live: LiveEpisode, wire: Body) -> OpenTurn | None:
        """The turn a call that does not say whether it is a retry belongs to, wherever its first attempt was made:
        an open turn with its body no agent waits on (its agent hung up, or its replica is gone), or the episode's
        latest turn, answered with its body, its reply handed over by no agent here."""
        found = await self.attach(live, wire, orphaned=True)
        return found or unsent(await self._database.unsent(live.episode.id, wire), live, wire)

    async def attach(self, live: LiveEpisode, wire: Body, *, orphaned: bool = False) -> OpenTurn | None:
        """The open turn an SDK retry (this exact body) belongs to, wherever its first attempt was parked (with
        `orphaned`, only one no agent waits on): this replica holds it from now on, and the retry waits on it."""
        turn = await self._database.attach(live.episode.id, wire, orphaned=orphaned)
        if turn is None:
            return None
        open_turn = self._open_turns.get(turn.id) or self._adopt(turn)
        open_turn.exchanges += 1
        if open_turn.grace_timer is not None:
            open_turn.grace_timer.cancel()
            open_turn.grace_timer = None
        self._open_turns.restore(open_turn)
        return open_turn

    def _adopt(self, turn: Turn) -> OpenTurn:
        """Hold an open turn another replica held (its agent's retry came here, or that replica died). A trainer may
        have answered it while the statement that took it ran: the answer's notice then found no open turn here."""
        open_turn = self._open_turns.adopt(replace(turn, status=TurnStatus.PARKED), self._lease_s)
        self.parked(open_turn)
        return open_turn

    def parked(self, open_turn: OpenTurn) -> None:
        """A call's turn is parked here: if its answer was heard already, hand it over from the database."""
        if open_turn.turn.id in self._early:
            del self._early[open_turn.turn.id]
            self._endings.submit(self._settle([open_turn.turn.id]))

    def pause(self, mode: str | None, retry_after_s: float, policy_version: str | None = None) -> None:
        """Tell every replica of a pause (or of its end, None, with the policy version it names), in order."""
        self._after(lambda: self._database.set_pause(mode, retry_after_s, policy_version))

    def away(self, open_turn: OpenTurn, away: bool) -> None:
        """Keep a turn out of every replica's queue while its agent is away (it hung up), or put it back."""
        if self._open_turns.get(open_turn.turn.id) is open_turn:
            self._after(lambda: self._database.away(open_turn.turn.id, away))

    def _after(self, change: Callable[[], Awaitable[None]]) -> None:
        """Make a change once the ones asked before it are made (a hang-up, then its retry: held, then back)."""
        self._in_order = self._endings.submit(self._in_turn(self._in_order, change))

    async def _in_turn(self, before: asyncio.Future[None] | None, change: Callable[[], Awaitable[None]]) -> None:
        if before is not None:
            await asyncio.wait([before])
        await change()

    # What the others did

    def _heard(self, kind: str, payload: str) -> None:
        if kind == "parked":
            self._pollers.wake(payload)
        elif kind == "answered" and self._open_turns.get(payload) is None:
            self._early[payload] = None  # a turn of another replica's, or of a call not parked here yet
            while len(self._early) > _EARLY_KEPT:
                self._early.popitem(last=False)
        elif kind == "answered":
            if not self._answered:  # one read for the answers heard together (a trainer answers in batches)
                self._endings.submit(self._settle_answered())
            self._answered.add(payload)
        elif kind == "closed":
            self._endings.submit(self._closed(payload))
        elif kind == "paused":
            self._endings.submit(self._obey_pause())
        elif kind == "":  # notices may have been lost: look again at all this replica waits on
            self._pollers.wake("*")
            self._endings.submit(self._settle([turn.id for turn in self._open_turns.turns(len(self._open_turns))]))

    async def _settle_answered(self) -> None:
        await asyncio.sleep(0)  # the answers this replica recorded itself are handed over by then: no read for them
        answered, self._answered = self._answered, set()
        await self._settle([turn_id for turn_id in answered if self._open_turns.get(turn_id) is not None])

    async def _settle(self, turn_ids: list[str]) -> None:
        """Hand over what the database holds for turns this replica's agents wait on and others have settled."""
        if not turn_ids:
            return
        answered, closed = [], []
        for turn in (await self._database.turns(turn_ids)).values():
            open_turn = self._open_turns.get(turn.id)
            if open_turn is None or turn.status.open:
                continue
            if turn.status is TurnStatus.ANSWERED and turn.reply is not None:
                answered.append((open_turn, replace(turn, lease_id=None)))
                if (live := self._episodes.get(turn.episode_id)) is not None:
                    live.account(turn, turn.reply)
            else:  # its agent hears it is closed (failed, expired, abandoned), why in its reason
                closed.append((open_turn, turn))
        self._endings.settle(answered, recorded=True)
        self._endings.settle(closed, recorded=True)

    async def _closed(self, episode_id: str) -> None:
        """Another replica closed an episode (its open turns are failed already): its agents here hear so."""
        episode = await self._store.episode(episode_id)
        if episode is None or not episode.status.closed:
            return
        if (live := self._episodes.get(episode_id)) is not None:
            live.episode = episode  # its calls in flight here see it closed
        self._episodes.bury(episode)
        self._pollers.wake(episode_id)  # a trainer stepping through it learns it has ended
        error, now = closed_error(episode), self._now()
        ended = [
            (
                open_turn,
                replace(open_turn.turn, status=TurnStatus.FAILED, reason=error.message, ended_at=now, lease_id=None),
            )
            for open_turn in self._open_turns.of_episode(episode_id)
        ]
        self._endings.settle(ended, error, recorded=True)

    async def _obey_pause(self) -> None:
        assert self._pause is not None, "obeyed only once started"
        mode, retry_after_s, policy_version = await self._database.pause_state()
        if policy_version is not None:
            self._answers.policy_version = policy_version
        if mode is not None:
            self._pause.start(mode, retry_after_s)
        elif self._pause.mode is not None:
            self._pause.lift()

    # Liveness

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._database.heartbeat_s)
            try:
                await self._take_over()
            except StorageError as e:
                log.warning("heartbeat failed: %s", e.message)

    async def _take_over(self) -> int:
        """Say this replica is alive, and take over the open turns of replicas that are not."""
        taken = await self._database.beat()
        failed: list[Turn] = []
        for turn, held_for in taken:
            if self._open_turns.get(turn.id) is not None:  # its own, taken back (it was thought dead for a while)
                continue
            live = await self._episodes.load(turn.episode_id)
            if live is None:
                failed.append(replace(turn, status=TurnStatus.FAILED, ended_at=self._now(), reason="episode closed"))
                continue
            # Its agent is not connected here: it waits for the agent's retry, pullable all the while (its lease,
            # if it has one, stands: leases are the database's).
            open_turn = self._adopt(turn)
            self._deadlines.after_restart(open_turn)
            answerer = live.answerer(turn.request)
            if held_for == "model" and answerer is not None:  # a model answers it: it goes to the model again
                self._answers.by_model(open_turn, answerer)
        if failed:
            await self._store.save_turns(failed)
        if taken:
            log.info("took over %d open turns of replicas that stopped", len(taken))
        return len(taken)
