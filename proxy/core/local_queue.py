"""LocalQueue: this process's open turns are the queue (one process per database).

A pull leases from the open turns, waiting for a turn if none is ready; a lease lives in memory only, costing no
write: after a restart its turn is parked again, and a reply naming it still lands (`_before_restart`). A reply is
checked against the open turns and recorded in the store before its agent hears it (`LocalReplies`). A restart
loses no turn: `start` takes back the open turns the store holds, for their agents' retries to find.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

from proxy.core.answers import Answer, Answers, Outcome, Target, handed_out_again, same_reply
from proxy.core.context import Context
from proxy.core.episodes import LiveEpisode
from proxy.core.errors import Conflict, TrajproxyError, TurnClosed
from proxy.core.open_turns import OpenTurn, Pause, delivery_of
from proxy.core.recovery import adopt, left_open
from proxy.core.retries import retried
from proxy.core.values import Reply, Turn, TurnStatus

log = logging.getLogger("trajproxy")


class LocalQueue:
    """The `TurnQueue` of a process that is its database's only one: nobody else records its turns, so there are no
    others to tell of anything, and a write refused as stale is not theirs."""

    answers: Answers

    def __init__(self, *, context: Context) -> None:
        self._context = context
        self.answers = Answers(context=context, replies=LocalReplies(context))

    @property
    def waiting(self) -> int:
        return self._context.open_turns.poller_count

    async def start(self, pause: Pause) -> int:
        """Take back the open turns a previous process left in the store (it stopped or crashed holding them).

        Their agents' connections died with that process, so each waits out of the queue, as a turn whose agent
        hung up does: its agent's SDK retry (the same body) reattaches to it within the restart grace (longer
        than the retry grace: an SDK deep in its backoff comes back late), or it is recorded abandoned. A leased
        one keeps its lease (renewed), so the reply its trainer sends still lands; answered before the retry
        comes, it is replayed to the retry. A turn a model answers goes to it again."""
        context = self._context
        left = await left_open(context.store, context.episodes, context.clock())
        for open_turn, answerer in adopt(left, context.open_turns, context.lease_s):
            context.deadlines.after_restart(open_turn)
            if answerer is not None:
                self.answers.by_model(open_turn, answerer)
        await context.store.save_turns(left.closed)
        if left.episodes:
            log.info("took back %d open turns of %d episodes from the store", len(left.waiting), left.episodes)
        return len(left.waiting)

    def add(self, turn: Turn, held_for: str | None) -> Awaitable[None]:
        return self._context.store.add_turn(turn)

    async def retried(self, live: LiveEpisode, wire: bytes) -> OpenTurn | None:
        return await retried(self._context.open_turns, self._context.store, live, wire)

    async def turn(self, turn_id: str) -> Turn:
        return await self._context.endings.turn(turn_id)

    async def pull(self, episode_id: str | None, max_turns: int, wait_s: float, lease_s: float | None) -> list[Turn]:
        context = self._context
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not (
            open_turns := context.open_turns.take(episode_id, max_turns, lease_s or context.lease_s, context.clock())
        ):
            remaining = deadline - loop.time()
            if remaining <= 0 or (episode_id is not None and context.episodes.closed(episode_id)):
                return []
            await context.open_turns.wait(episode_id, remaining)
        handed = [open_turn.turn for open_turn in open_turns]
        context.endings.observer.leased(handed)
        return handed

    def release(self, turns: Sequence[Turn]) -> None:
        for turn in turns:
            open_turn = self._context.open_turns.get(turn.id)
            if open_turn is not None and open_turn.turn.lease_id == turn.lease_id:
                self._context.open_turns.release(open_turn)


class LocalReplies:
    """Replies checked against this process's open turns and recorded in the store."""

    def __init__(self, context: Context) -> None:
        self._context = context
        self._pending: dict[str, asyncio.Future[None]] = {}  # turn id -> the write recording its reply

    async def targets(self, answers: Sequence[Answer]) -> list[Target | TrajproxyError | None]:
        targets: list[Target | TrajproxyError | None] = []
        for turn_id, _, lease_id in answers:
            open_turn = self._context.open_turns.get(turn_id)
            if open_turn is not None and lease_id is not None and (before := _before_restart(open_turn.turn, lease_id)):
                open_turn.turn = replace(open_turn.turn, deliveries=before)  # the delivery its reply names is recorded
            elif open_turn is not None and lease_id is not None and open_turn.turn.lease_id != lease_id:
                targets.append(handed_out_again(turn_id, lease_id))
                continue
            targets.append(None if open_turn is None else Target(open_turn.turn, open_turn))
        return targets

    async def record(self, targets: Sequence[tuple[Target, Reply]], now: float) -> list[Outcome | None]:
        context = self._context
        endings = []
        for target, reply in targets:
            open_turn = target.open_turn
            assert open_turn is not None
            ended = replace(
                open_turn.turn,
                status=TurnStatus.ANSWERED,
                reason=None,
                reply=reply,
                answered_at=now,
                ended_at=now,
                lease_id=None,
            )
            endings.append((open_turn, ended))
        # Each one answered, but those settled by now (an earlier answer in this batch, its agent gone, …): None
        settled, written = context.endings.settle(endings)
        if written is None:
            return list(settled)
        for turn in settled:
            if turn is not None:
                self._pending[turn.id] = written
                assert turn.reply is not None
                if (live := context.episodes.get(turn.episode_id)) is not None:
                    live.account(turn, turn.reply)
        written.add_done_callback(lambda _: self._written(settled))
        try:
            await asyncio.shield(written)
        except TrajproxyError as e:
            return [e if turn is not None else None for turn in settled]
        return list(settled)

    async def check_repeat(self, turn_id: str, reply: Reply) -> Turn:
        pending = self._pending.get(turn_id)
        if pending is not None:  # an answer is being recorded: check this one against it once it is
            await asyncio.shield(pending)
        turn = await self._context.endings.turn(turn_id)
        if turn.status is TurnStatus.ANSWERED:
            if turn.reply is not None and same_reply(turn.reply, reply):
                return turn
            raise Conflict(f"turn {turn_id} already has a different reply; replies cannot be changed")
        if turn.status.open:
            raise TurnClosed(f"turn {turn_id} is not waiting on this proxy any more; its agent is gone")
        raise TurnClosed(f"turn {turn_id} is {turn.status} ({turn.reason}); it can no longer be answered")

    async def forwarding(self, turn_id: str, lease_id: str | None) -> tuple[Turn, str | None, Callable[[float], None]]:
        context = self._context
        open_turn = context.open_turns.get(turn_id)
        if open_turn is None:
            turn = await context.endings.turn(turn_id)
            raise TurnClosed(f"turn {turn_id} is {turn.status}; it can no longer be answered")
        if lease_id is not None and open_turn.turn.lease_id != lease_id:
            raise Conflict(f"lease {lease_id} on turn {turn_id} has expired; the turn was not forwarded")
        context.open_turns.reserve(open_turn, context.clock())
        return open_turn.turn, open_turn.turn.lease_id, lambda lease_s: context.open_turns.renew(open_turn, lease_s)

    def _written(self, settled: list[Turn | None]) -> None:
        for turn in settled:
            if turn is not None:
                self._pending.pop(turn.id, None)


def _before_restart(turn: Turn, lease_id: str) -> int | None:
    """The delivery a lease names, if an earlier process handed it out: leases live in memory, so a turn taken back
    after a restart is parked, and a lease on it with a later delivery than this process knows can be no other.
    Its trainer's reply lands."""
    delivery = delivery_of(turn.id, lease_id)
    if turn.status is not TurnStatus.PARKED or delivery is None:
        return None
    return delivery if delivery > turn.deliveries else None
