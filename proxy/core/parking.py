"""The parking lot: open turns waiting for a trainer, their leases, and the futures their agents await.

Everything here is synchronous and in memory, so each step is atomic on the event loop; the broker
records each step in the store. A turn is in exactly one place: `ready` (parked, waiting to be pulled)
or leased (a trainer holds it until its lease expires). `settle` takes it out of the lot for good.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import islice

from proxy.core.bell import Bell
from proxy.core.values import Turn, TurnStatus


@dataclass(eq=False, slots=True)
class Slot:
    """One open turn: its latest state and the future its agent is waiting on."""

    turn: Turn
    answer: asyncio.Future[Turn]
    lease_timer: asyncio.TimerHandle | None = field(default=None)
    exchanges: int = 1  # agent HTTP exchanges waiting on this turn (an SDK retry attaches a second)
    withdrawn: bool = False  # out of the queue: its agent hung up (a retry may come), or new calls are held
    grace_timer: asyncio.TimerHandle | None = field(default=None)

    def fail(self, error: BaseException) -> None:
        """Fail the turn's answer for the agent exchanges waiting on it; its agent may be gone, so none may ever
        look (the error counts as seen, or asyncio would log it as never retrieved)."""
        if not self.answer.done():
            self.answer.set_exception(error)
            self.answer.exception()


class ParkingLot:
    def __init__(self, on_lease_expired: Callable[[Slot], None]) -> None:
        self._slots: dict[str, Slot] = {}
        self._ready: OrderedDict[str, Slot] = OrderedDict()
        self._ready_by_episode: dict[str, OrderedDict[str, Slot]] = {}
        self._pollers = Bell()  # trainers' pulls waiting for a turn to become ready
        self._on_lease_expired = on_lease_expired

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    @property
    def leased_count(self) -> int:
        return sum(slot.turn.status is TurnStatus.LEASED for slot in self._slots.values())

    @property
    def poller_count(self) -> int:
        return self._pollers.waiting

    def get(self, turn_id: str) -> Slot | None:
        return self._slots.get(turn_id)

    def turns(self, limit: int) -> list[Turn]:
        """Up to `limit` open turns, in the order they were parked."""
        return [slot.turn for slot in islice(self._slots.values(), limit)]

    def of_episode(self, episode_id: str) -> list[Slot]:
        return [slot for slot in self._slots.values() if slot.turn.episode_id == episode_id]

    def park(self, turn: Turn) -> Slot:
        slot = Slot(turn, asyncio.get_running_loop().create_future())
        self._slots[turn.id] = slot
        self._make_ready(slot, front=False)
        return slot

    def adopt(self, turn: Turn, lease_s: float) -> Slot:
        """Take in an open turn that an earlier process recorded, whose agent is not connected: out of the queue,
        as `withdraw` leaves a turn, until its agent's retry restores it. A leased turn keeps the lease its
        trainer holds, running `lease_s` from now."""
        slot = Slot(turn, asyncio.get_running_loop().create_future(), exchanges=0, withdrawn=True)
        self._slots[turn.id] = slot
        if turn.status is TurnStatus.LEASED:
            slot.turn = replace(turn, lease_id=lease_of(turn.id, turn.deliveries))
            self.renew(slot, lease_s)
        return slot

    def take(self, episode_id: str | None, max_turns: int, lease_s: float, now: float) -> list[Slot]:
        """Lease up to `max_turns` ready turns, oldest first, to the caller."""
        queue = self._ready if episode_id is None else self._ready_by_episode.get(episode_id)
        taken: list[Slot] = []
        while queue and len(taken) < max_turns:
            _, slot = queue.popitem(last=False)
            taken.append(self._lease(slot, lease_s, now))
        return taken

    def hold(self, slot: Slot, now: float) -> None:
        """Lease a turn with no expiry while it is answered from elsewhere, so no poller takes it meanwhile."""
        if self._slots.get(slot.turn.id) is not slot:
            return
        if slot.turn.status is TurnStatus.PARKED:
            self._lease(slot, 0.0, now)
        self._cancel_lease(slot)

    def renew(self, slot: Slot, lease_s: float) -> None:
        """Restart the expiry of a held lease (the answer from elsewhere did not come)."""
        if self._slots.get(slot.turn.id) is slot and slot.turn.status is TurnStatus.LEASED:
            self._cancel_lease(slot)
            loop = asyncio.get_running_loop()
            slot.lease_timer = loop.call_later(lease_s, self._expire_lease, slot, slot.turn.lease_id)

    def _lease(self, slot: Slot, lease_s: float, now: float) -> Slot:
        self._unready(slot)
        deliveries = slot.turn.deliveries + 1
        slot.turn = replace(
            slot.turn,
            status=TurnStatus.LEASED,
            deliveries=deliveries,
            lease_id=lease_of(slot.turn.id, deliveries),
            leased_at=now,
        )
        loop = asyncio.get_running_loop()
        slot.lease_timer = loop.call_later(lease_s, self._expire_lease, slot, slot.turn.lease_id)
        return slot

    def release(self, slot: Slot) -> None:
        """Put a leased turn back at the front of the queue (lease expired, or its poller is gone)."""
        if self._slots.get(slot.turn.id) is not slot or slot.turn.status is not TurnStatus.LEASED:
            return
        self._cancel_lease(slot)
        slot.turn = replace(slot.turn, status=TurnStatus.PARKED, lease_id=None)
        if not slot.withdrawn:
            self._make_ready(slot, front=True)

    def withdraw(self, slot: Slot) -> None:
        """Keep an open turn out of the queue (its agent hung up); a lease already held stands."""
        if self._slots.get(slot.turn.id) is slot:
            slot.withdrawn = True
            self._unready(slot)

    def restore(self, slot: Slot) -> None:
        """Undo `withdraw` (the agent's retry came back for the turn)."""
        if self._slots.get(slot.turn.id) is slot and slot.withdrawn:
            slot.withdrawn = False
            if slot.turn.status is TurnStatus.PARKED:
                self._make_ready(slot, front=True)

    def settle(self, turn_id: str) -> Slot | None:
        """Take a turn out of the lot for good; returns None if it was already settled."""
        slot = self._slots.pop(turn_id, None)
        if slot is not None:
            self._unready(slot)
            self._cancel_lease(slot)
            if slot.grace_timer is not None:
                slot.grace_timer.cancel()
                slot.grace_timer = None
        return slot

    async def wait(self, episode_id: str | None, timeout_s: float) -> None:
        """Wait until a turn this poller could take becomes ready, or the timeout passes."""
        await self._pollers.wait(episode_id, timeout_s)

    def _make_ready(self, slot: Slot, *, front: bool) -> None:
        turn_id, episode_id = slot.turn.id, slot.turn.episode_id
        self._ready[turn_id] = slot
        by_episode = self._ready_by_episode.setdefault(episode_id, OrderedDict())
        by_episode[turn_id] = slot
        if front:
            self._ready.move_to_end(turn_id, last=False)
            by_episode.move_to_end(turn_id, last=False)
        self.wake(episode_id)

    def _unready(self, slot: Slot) -> None:
        turn_id, episode_id = slot.turn.id, slot.turn.episode_id
        self._ready.pop(turn_id, None)
        by_episode = self._ready_by_episode.get(episode_id)
        if by_episode is not None:
            by_episode.pop(turn_id, None)
            if not by_episode:
                del self._ready_by_episode[episode_id]

    def wake(self, episode_id: str) -> None:
        """Wake the pollers that wait on this episode's turns (a turn is ready, or the episode has ended)."""
        self._pollers.ring(episode_id)

    def _expire_lease(self, slot: Slot, lease_id: str | None) -> None:
        if slot.turn.lease_id != lease_id or self._slots.get(slot.turn.id) is not slot:
            return
        slot.lease_timer = None
        self.release(slot)
        self._on_lease_expired(slot)

    @staticmethod
    def _cancel_lease(slot: Slot) -> None:
        if slot.lease_timer is not None:
            slot.lease_timer.cancel()
            slot.lease_timer = None


def lease_of(turn_id: str, deliveries: int) -> str:
    """A lease names its turn and its delivery, so a store's record of a leased turn tells its lease."""
    return f"{turn_id}.{deliveries}"


def delivery_of(turn_id: str, lease_id: str) -> int | None:
    """The delivery a lease on this turn names; None if it is not a lease on this turn."""
    named, _, delivery = lease_id.rpartition(".")
    return int(delivery) if named == turn_id and delivery.isdigit() else None
