"""Pulls and answers when replicas share one database (shared mode): the queue is the database's, not this
replica's lot. A pull leases there (no two trainers anywhere get the same turn) and waits for a notice that turns
were parked; an answer is recorded there, if the turn is still open under the lease it names, and the replica
holding the turn's agent hears of it and hands the reply over (`Replicas`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from proxy.core.answers import Answer, Answers, same_reply
from proxy.core.errors import Conflict, NotFound, TrajproxyError, TurnClosed
from proxy.core.parking import Slot, delivery_of, lease_of
from proxy.core.ports import SharedQueue
from proxy.core.pulls import Pulls
from proxy.core.values import ModelRoute, Reply, Turn, TurnStatus

_LEASE_SLACK_S = 0.05  # a waiting pull looks again this long after a running lease should have run out


class Bell:
    """Wakes waiting pulls when turns may have become pullable; counts its rings, so a pull that found none can
    tell whether one came while it looked."""

    def __init__(self) -> None:
        self.rings = 0  # how many times it rang: a pull that found nothing sees whether it rang while it looked
        self._waiting: list[tuple[str | None, asyncio.Future[None]]] = []

    def ring(self, episode_id: str) -> None:
        """Turns of this episode ("*": of any) may be pullable."""
        self.rings += 1
        keep: list[tuple[str | None, asyncio.Future[None]]] = []
        for wanted, waiter in self._waiting:
            if episode_id == "*" or wanted is None or wanted == episode_id:
                if not waiter.done():
                    waiter.set_result(None)
            else:
                keep.append((wanted, waiter))
        self._waiting = keep

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def wait(self, episode_id: str | None, timeout_s: float) -> None:
        entry = (episode_id, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            async with asyncio.timeout(timeout_s):
                await entry[1]
        except TimeoutError:
            pass
        finally:
            if entry in self._waiting:
                self._waiting.remove(entry)


class SharedPulls(Pulls):
    def __init__(self, *args: Any, queue: SharedQueue, bell: Bell, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._queue = queue
        self._bell = bell

    async def pull(self, episode_id: str | None, max_turns: int, wait_s: float, lease_s: float | None) -> list[Turn]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            rung = self._bell.rings
            leasing = asyncio.ensure_future(
                self._queue.lease(episode_id, max_turns, lease_s or self._lease_s, self._now())
            )
            try:
                turns, lease_ends_in_s = await asyncio.shield(leasing)
            except asyncio.CancelledError:  # the poller left: what was leased for it goes back at once
                leasing.add_done_callback(self._give_back)
                raise
            if turns:
                handed = [replace(turn, lease_id=lease_of(turn.id, turn.deliveries)) for turn in turns]
                self._ledger.observer.leased(handed)
                return handed
            remaining = deadline - loop.time()
            if remaining <= 0 or (episode_id is not None and self._episodes.closed(episode_id)):
                return []
            if self._bell.rings == rung:  # nothing parked while it looked: wait for a notice, or a lease to run out
                until_s = remaining if lease_ends_in_s is None else min(remaining, lease_ends_in_s + _LEASE_SLACK_S)
                await self._bell.wait(episode_id, until_s)

    def release(self, turns: Sequence[Turn]) -> None:
        self._ledger.submit(self._queue.release(turns))

    def _give_back(self, leasing: asyncio.Future[tuple[list[Turn], float | None]]) -> None:
        if not leasing.cancelled() and leasing.exception() is None:
            self.release(leasing.result()[0])


class SharedAnswers(Answers):
    def __init__(self, *args: Any, queue: SharedQueue, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._queue = queue

    async def reply_all(self, answers: Sequence[Answer]) -> list[Turn | TrajproxyError]:
        found = await self._queue.turns([turn_id for turn_id, _, _ in answers])
        outcomes: list[Turn | TrajproxyError | None] = [None] * len(answers)
        asked: list[tuple[int, Turn, Reply, int | None]] = []
        for i, (turn_id, reply, lease_id) in enumerate(answers):
            turn = found.get(turn_id)
            if turn is None:
                outcomes[i] = NotFound(f"no turn {turn_id!r}")
                continue
            try:
                asked.append((i, turn, reply, self._delivery(turn_id, lease_id)))
            except Conflict as e:
                outcomes[i] = e
        counted = await self._completed([(turn, reply) for _, turn, reply, _ in asked])
        now = self._now()
        answered = [
            replace(turn, status=TurnStatus.ANSWERED, reply=reply, answered_at=now, ended_at=now, reason=None)
            for (_, turn, _, _), reply in zip(asked, counted, strict=True)
        ]
        recorded = await self._queue.answer(
            [(turn, delivery) for turn, (_, _, _, delivery) in zip(answered, asked, strict=True)]
        )
        seen: set[str] = set()  # the first answer to a turn in the batch is the one recorded
        for (i, turn, reply, _), done in zip(asked, answered, strict=True):
            if done.id in recorded and done.id not in seen:
                outcomes[i] = self._recorded(done)
            else:
                try:
                    outcomes[i] = await self._judged(turn.id, reply)
                except TrajproxyError as e:
                    outcomes[i] = e
            seen.add(done.id)
        return [outcome for outcome in outcomes if outcome is not None]

    async def forward(self, turn_id: str, route: ModelRoute, lease_id: str | None, lease_s: float | None) -> Turn:
        turn = (await self._queue.turns([turn_id])).get(turn_id)
        if turn is None:
            raise NotFound(f"no turn {turn_id!r}")
        if not turn.status.open:
            raise TurnClosed(f"turn {turn_id} is {turn.status}; it can no longer be answered")
        if lease_id is not None and self._delivery(turn_id, lease_id) != turn.deliveries:
            raise Conflict(f"lease {lease_id} on turn {turn_id} has expired; the turn was not forwarded")
        reply = await self._upstream.complete(route, turn.request)
        return await self.reply(turn_id, replace(reply, answered_by=route.spec), lease_id)

    def _delivery(self, turn_id: str, lease_id: str | None) -> int | None:
        """The delivery a reply's lease names; None for a reply under no lease, or this replica's own hold of a turn
        a model (or a fork's replay) answers, which no trainer can lease."""
        slot = self._lot.get(turn_id)
        if lease_id is None or (slot is not None and slot.turn.lease_id == lease_id):
            return None
        if (delivery := delivery_of(turn_id, lease_id)) is None:
            raise Conflict(f"{lease_id!r} is not a lease on turn {turn_id}; this reply was not recorded")
        return delivery

    def _recorded(self, turn: Turn) -> Turn:
        """An answer this replica recorded: its agent hears it now if this replica holds the turn (else its holder
        hears the notice), and its episode counts what it used."""
        slot = self._lot.get(turn.id)
        if slot is not None:
            settle_answered(self._lot.settle, slot, turn)
            self._ledger.remember(slot.turn)
        self._ledger.observer.settled(turn)
        assert turn.reply is not None
        if (live := self._episodes.get(turn.episode_id)) is not None:
            live.account(turn, turn.reply)
        return turn

    async def _judged(self, turn_id: str, reply: Reply) -> Turn:
        """A reply that found its turn no longer open under its lease: the same again succeeds, else why not."""
        turn = (await self._queue.turns([turn_id])).get(turn_id)
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


def settle_answered(settle: Any, slot: Slot, turn: Turn) -> None:
    """Hand an answer recorded in the database to the agent waiting on this replica's slot, once."""
    if settle(turn.id) is None:
        return
    slot.turn = replace(turn, lease_id=None)
    if not slot.answer.done():
        slot.answer.set_result(slot.turn)
