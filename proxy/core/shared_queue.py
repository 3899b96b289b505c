"""SharedQueue: replicas share one database, and the queue is the database's, not any one replica's open turns.

A pull leases there (no two trainers anywhere get the same turn) and waits for a notice that turns were parked; an
answer is recorded there, if the turn is still open under the lease it names, and the replica holding the turn's
agent hears of it and hands the reply over. `Replicas` keeps this replica in step with the others, and the broker tells
them what it did through this queue, which is its `Others` too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

from proxy.core.answers import Answer, Answers, Outcome, Target, same_reply
from proxy.core.chunks import Body
from proxy.core.context import Context
from proxy.core.episodes import LiveEpisode
from proxy.core.errors import Conflict, NotFound, TrajproxyError, TurnClosed
from proxy.core.open_turns import OpenTurn, Pause, Pollers, delivery_of, handed_out_again, lease_of
from proxy.core.ports import SharedDatabase
from proxy.core.replicas import Replicas
from proxy.core.retries import retried
from proxy.core.values import Reply, Turn, TurnStatus

_LEASE_SLACK_S = 0.05  # a waiting pull looks again this long after a running lease should have run out


class SharedQueue:
    """The `TurnQueue` replicas share, and the `Others` each replica tells what it did."""

    answers: Answers

    def __init__(self, *, context: Context, database: SharedDatabase) -> None:
        self._context = context
        self._database = database
        self._pollers = Pollers()
        self.answers = Answers(context=context, replies=SharedReplies(context, database))
        self._replicas = Replicas(context=context, database=database, answers=self.answers, pollers=self._pollers)

    @property
    def waiting(self) -> int:
        return self._pollers.waiting

    async def start(self, pause: Pause) -> int:
        """Join the replicas: hear the others, obey the pause, take over what dead replicas left."""
        return await self._replicas.start(pause)

    async def stop(self) -> None:
        await self._replicas.stop()

    def add(self, turn: Turn, held_for: str | None) -> Awaitable[None]:
        return self._database.add_turn(turn, held_for)

    def parked(self, open_turn: OpenTurn) -> None:
        self._replicas.parked(open_turn)  # a trainer elsewhere may have answered it already

    async def retried(self, live: LiveEpisode, wire: Body) -> OpenTurn | None:
        found = await retried(self._context.open_turns, self._context.store, live, wire)
        return await self._replicas.retried(found, live, wire)

    async def unmarked_retry(self, live: LiveEpisode, wire: Body) -> OpenTurn | None:
        return await self._replicas.unmarked_retry(live, wire)

    def away(self, open_turn: OpenTurn) -> None:
        if open_turn.withdrawn:
            self._replicas.away(open_turn, True)

    async def closed(self, episode_id: str, why: str) -> None:
        await self._database.episode_closed(episode_id, why, self._context.clock())

    async def turn(self, turn_id: str) -> Turn:
        if self._context.open_turns.get(turn_id) is not None:  # open: its lease is the database's
            return (await self._database.turns([turn_id]))[turn_id]
        return await self._context.endings.turn(turn_id)

    async def pull(self, episode_id: str | None, max_turns: int, wait_s: float, lease_s: float | None) -> list[Turn]:
        context = self._context
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            woken = self._pollers.wakes
            leasing = asyncio.ensure_future(
                self._database.lease(episode_id, max_turns, lease_s or context.lease_s, context.clock())
            )
            try:
                turns, lease_ends_in_s = await asyncio.shield(leasing)
            except asyncio.CancelledError:  # the poller left: what was leased for it goes back at once
                leasing.add_done_callback(self._give_back)
                raise
            if turns:
                handed = [replace(turn, lease_id=lease_of(turn.id, turn.deliveries)) for turn in turns]
                context.endings.observer.leased(handed)
                return handed
            remaining = deadline - loop.time()
            if remaining <= 0 or (episode_id is not None and context.episodes.closed(episode_id)):
                return []
            if self._pollers.wakes == woken:  # nothing parked while it looked: wait for a notice, or a lease to run out
                until_s = remaining if lease_ends_in_s is None else min(remaining, lease_ends_in_s + _LEASE_SLACK_S)
                await self._pollers.wait(episode_id, until_s)

    def release(self, turns: Sequence[Turn]) -> None:
        self._context.endings.submit(self._database.release(turns))

    def pause(self, mode: str | None, retry_after_s: float, policy_version: str | None = None) -> None:
        self._replicas.pause(mode, retry_after_s, policy_version)

    def _give_back(self, leasing: asyncio.Future[tuple[list[Turn], float | None]]) -> None:
        if not leasing.cancelled() and leasing.exception() is None:
            self.release(leasing.result()[0])


class SharedReplies:
    """Replies checked against the database replicas share and recorded there."""

    def __init__(self, context: Context, database: SharedDatabase) -> None:
        self._context = context
        self._database = database

    async def targets(self, answers: Sequence[Answer]) -> list[Target | TrajproxyError | None]:
        found = await self._database.turns([turn_id for turn_id, _, _ in answers])
        targets: list[Target | TrajproxyError | None] = []
        for turn_id, _, lease_id in answers:
            turn = found.get(turn_id)
            if turn is None:
                targets.append(NotFound(f"no turn {turn_id!r}"))
                continue
            try:
                delivery = self._delivery(turn_id, lease_id)
            except Conflict as e:
                targets.append(e)
                continue
            if delivery is not None and turn.status.open and delivery != turn.deliveries:
                targets.append(handed_out_again(turn_id, lease_id))
                continue
            targets.append(Target(turn, delivery=delivery))
        return targets

    async def record(self, targets: Sequence[tuple[Target, Reply]], now: float) -> list[Outcome | None]:
        answered = [
            replace(target.turn, status=TurnStatus.ANSWERED, reply=reply, answered_at=now, ended_at=now, reason=None)
            for target, reply in targets
        ]
        recorded = await self._database.answer(
            [(turn, target.delivery) for turn, (target, _) in zip(answered, targets, strict=True)]
        )
        outcomes: list[Outcome | None] = []
        seen: set[str] = set()  # the first answer to a turn in the batch is the one recorded
        for turn in answered:
            outcomes.append(turn if turn.id in recorded and turn.id not in seen else None)
            seen.add(turn.id)
        self._recorded([turn for turn in outcomes if isinstance(turn, Turn)])
        return outcomes

    async def check_repeat(self, turn_id: str, reply: Reply) -> Turn:
        turn = (await self._database.turns([turn_id])).get(turn_id)
        if turn is None:
            raise NotFound(f"no turn {turn_id!r}")
        if turn.status is TurnStatus.ANSWERED:
            if turn.reply is not None and same_reply(turn.reply, reply):
                return turn
            raise Conflict(f"turn {turn_id} already has a different reply; replies cannot be changed")
        if turn.status.open:
            raise Conflict(
                f"the lease on turn {turn_id} has expired and the turn was handed out again; this reply was not "
                "recorded"
            )
        raise TurnClosed(f"turn {turn_id} is {turn.status} ({turn.reason}); it can no longer be answered")

    async def forwarding(self, turn_id: str, lease_id: str | None) -> tuple[Turn, str | None, Callable[[float], None]]:
        turn = (await self._database.turns([turn_id])).get(turn_id)
        if turn is None:
            raise NotFound(f"no turn {turn_id!r}")
        if not turn.status.open:
            raise TurnClosed(f"turn {turn_id} is {turn.status}; it can no longer be answered")
        if lease_id is not None and self._delivery(turn_id, lease_id) != turn.deliveries:
            raise Conflict(f"lease {lease_id} on turn {turn_id} has expired; the turn was not forwarded")
        return turn, lease_id, _unchanged  # the lease is the database's, running all along

    def _delivery(self, turn_id: str, lease_id: str | None) -> int | None:
        """The delivery a reply's lease names; None for a reply under no lease, or this replica's own hold of a turn
        a model (or a fork's replay) answers, which no trainer can lease."""
        open_turn = self._context.open_turns.get(turn_id)
        if lease_id is None or (open_turn is not None and open_turn.turn.lease_id == lease_id):
            return None
        if (delivery := delivery_of(turn_id, lease_id)) is None:
            raise Conflict(f"{lease_id!r} is not a lease on turn {turn_id}; this reply was not recorded")
        return delivery

    def _recorded(self, answered: list[Turn]) -> None:
        """Answers this replica recorded: those of turns it holds end here and their agents hear them now (the holders
        of the others hear the notice), and their episodes count what they used."""
        context = self._context
        held = [
            (open_turn, replace(turn, lease_id=None))
            for turn in answered
            if (open_turn := context.open_turns.get(turn.id))
        ]
        context.endings.settle(held, recorded=True)
        for turn in answered:
            assert turn.reply is not None
            if (live := context.episodes.get(turn.episode_id)) is not None:
                live.account(turn, turn.reply)


def _unchanged(_lease_s: float) -> None:
    pass
