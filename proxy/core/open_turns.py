"""Open turns: this process's turns waiting for a trainer or leased to one, the futures their agents await, the
trainers' pulls waiting for a turn, and the pause that withholds new calls during a weight update.

Everything here is synchronous and in memory, so each step is atomic on the event loop; the broker records each
step in the store. A turn is in exactly one place: `ready` (parked, waiting to be pulled) or leased (a trainer
holds it until its lease expires). `settle` takes it out for good.

The pause: new calls are held out of the queue until resume (`hold` and `keep`; their streams get keep-alives) or
answered 429 with a Retry-After (`reject`). A served policy's new calls wait the same way: none reaches its server
until resume. With `hold` the pause waits for the turns in flight to drain; with `keep` it does not: a served call
already sent finishes on the weights it was sent to, and its reply carries the version it was sent under; every
call after a resume that names a `policy_version` carries it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import islice

from proxy.core.errors import BadRequest, Conflict, Paused
from proxy.core.values import Answerer, Turn, TurnStatus


class Pollers:
    """Trainers' pulls waiting for turns, woken when turns may have become pullable; counts its wake-ups, so a pull
    that found none can tell whether one came while it looked."""

    def __init__(self) -> None:
        self.wakes = 0  # how many wake-ups: a pull that found nothing sees whether one came while it looked
        self._waiting: list[tuple[str | None, asyncio.Future[None]]] = []

    def wake(self, episode_id: str) -> None:
        """Turns of this episode ("*": of any) may be pullable."""
        self.wakes += 1
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


@dataclass(eq=False, slots=True)
class OpenTurn:
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


class OpenTurns:
    """This process's open turns, by id, and the ready ones in the order trainers take them."""

    def __init__(self, on_lease_expired: Callable[[OpenTurn], None]) -> None:
        self._by_id: dict[str, OpenTurn] = {}
        self._ready: OrderedDict[str, OpenTurn] = OrderedDict()
        self._ready_by_episode: dict[str, OrderedDict[str, OpenTurn]] = {}
        self._pollers = Pollers()
        self._on_lease_expired = on_lease_expired

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    @property
    def leased_count(self) -> int:
        return sum(open_turn.turn.status is TurnStatus.LEASED for open_turn in self._by_id.values())

    @property
    def poller_count(self) -> int:
        return self._pollers.waiting

    def get(self, turn_id: str) -> OpenTurn | None:
        return self._by_id.get(turn_id)

    def turns(self, limit: int) -> list[Turn]:
        """Up to `limit` open turns, in the order they were parked."""
        return [open_turn.turn for open_turn in islice(self._by_id.values(), limit)]

    def of_episode(self, episode_id: str) -> list[OpenTurn]:
        return [open_turn for open_turn in self._by_id.values() if open_turn.turn.episode_id == episode_id]

    def park(self, turn: Turn) -> OpenTurn:
        open_turn = OpenTurn(turn, asyncio.get_running_loop().create_future())
        self._by_id[turn.id] = open_turn
        self._make_ready(open_turn, front=False)
        return open_turn

    def adopt(self, turn: Turn, lease_s: float) -> OpenTurn:
        """Take in an open turn that an earlier process recorded, whose agent is not connected: out of the queue,
        as `withdraw` leaves a turn, until its agent's retry restores it. A leased turn keeps the lease its
        trainer holds, running `lease_s` from now."""
        open_turn = OpenTurn(turn, asyncio.get_running_loop().create_future(), exchanges=0, withdrawn=True)
        self._by_id[turn.id] = open_turn
        if turn.status is TurnStatus.LEASED:
            open_turn.turn = replace(turn, lease_id=lease_of(turn.id, turn.deliveries))
            self.renew(open_turn, lease_s)
        return open_turn

    def take(self, episode_id: str | None, max_turns: int, lease_s: float, now: float) -> list[OpenTurn]:
        """Lease up to `max_turns` ready turns, oldest first, to the caller."""
        queue = self._ready if episode_id is None else self._ready_by_episode.get(episode_id)
        taken: list[OpenTurn] = []
        while queue and len(taken) < max_turns:
            _, open_turn = queue.popitem(last=False)
            taken.append(self._lease(open_turn, lease_s, now))
        return taken

    def reserve(self, open_turn: OpenTurn, now: float) -> None:
        """Lease a turn with no expiry while it is answered from elsewhere, so no poller takes it meanwhile."""
        if self._by_id.get(open_turn.turn.id) is not open_turn:
            return
        if open_turn.turn.status is TurnStatus.PARKED:
            self._lease(open_turn, 0.0, now)
        self._cancel_lease(open_turn)

    def renew(self, open_turn: OpenTurn, lease_s: float) -> None:
        """Restart the expiry of a reserved turn's lease (the answer from elsewhere did not come)."""
        if self._by_id.get(open_turn.turn.id) is open_turn and open_turn.turn.status is TurnStatus.LEASED:
            self._cancel_lease(open_turn)
            loop = asyncio.get_running_loop()
            open_turn.lease_timer = loop.call_later(lease_s, self._expire_lease, open_turn, open_turn.turn.lease_id)

    def _lease(self, open_turn: OpenTurn, lease_s: float, now: float) -> OpenTurn:
        self._unready(open_turn)
        deliveries = open_turn.turn.deliveries + 1
        open_turn.turn = replace(
            open_turn.turn,
            status=TurnStatus.LEASED,
            deliveries=deliveries,
            lease_id=lease_of(open_turn.turn.id, deliveries),
            leased_at=now,
        )
        loop = asyncio.get_running_loop()
        open_turn.lease_timer = loop.call_later(lease_s, self._expire_lease, open_turn, open_turn.turn.lease_id)
        return open_turn

    def release(self, open_turn: OpenTurn) -> None:
        """Put a leased turn back at the front of the queue (lease expired, or its poller is gone)."""
        if self._by_id.get(open_turn.turn.id) is not open_turn or open_turn.turn.status is not TurnStatus.LEASED:
            return
        self._cancel_lease(open_turn)
        open_turn.turn = replace(open_turn.turn, status=TurnStatus.PARKED, lease_id=None)
        if not open_turn.withdrawn:
            self._make_ready(open_turn, front=True)

    def withdraw(self, open_turn: OpenTurn) -> None:
        """Keep an open turn out of the queue (its agent hung up); a lease already held stands."""
        if self._by_id.get(open_turn.turn.id) is open_turn:
            open_turn.withdrawn = True
            self._unready(open_turn)

    def restore(self, open_turn: OpenTurn) -> None:
        """Undo `withdraw` (the agent's retry came back for the turn)."""
        if self._by_id.get(open_turn.turn.id) is open_turn and open_turn.withdrawn:
            open_turn.withdrawn = False
            if open_turn.turn.status is TurnStatus.PARKED:
                self._make_ready(open_turn, front=True)

    def settle(self, turn_id: str) -> OpenTurn | None:
        """Take a turn out of the open turns for good; returns None if it was already settled."""
        open_turn = self._by_id.pop(turn_id, None)
        if open_turn is not None:
            self._unready(open_turn)
            self._cancel_lease(open_turn)
            if open_turn.grace_timer is not None:
                open_turn.grace_timer.cancel()
                open_turn.grace_timer = None
        return open_turn

    async def wait(self, episode_id: str | None, timeout_s: float) -> None:
        """Wait until a turn this poller could take becomes ready, or the timeout passes."""
        await self._pollers.wait(episode_id, timeout_s)

    def _make_ready(self, open_turn: OpenTurn, *, front: bool) -> None:
        turn_id, episode_id = open_turn.turn.id, open_turn.turn.episode_id
        self._ready[turn_id] = open_turn
        by_episode = self._ready_by_episode.setdefault(episode_id, OrderedDict())
        by_episode[turn_id] = open_turn
        if front:
            self._ready.move_to_end(turn_id, last=False)
            by_episode.move_to_end(turn_id, last=False)
        self.wake(episode_id)

    def _unready(self, open_turn: OpenTurn) -> None:
        turn_id, episode_id = open_turn.turn.id, open_turn.turn.episode_id
        self._ready.pop(turn_id, None)
        by_episode = self._ready_by_episode.get(episode_id)
        if by_episode is not None:
            by_episode.pop(turn_id, None)
            if not by_episode:
                del self._ready_by_episode[episode_id]

    def wake(self, episode_id: str) -> None:
        """Wake the pollers that wait on this episode's turns (a turn is ready, or the episode has ended)."""
        self._pollers.wake(episode_id)

    def _expire_lease(self, open_turn: OpenTurn, lease_id: str | None) -> None:
        if open_turn.turn.lease_id != lease_id or self._by_id.get(open_turn.turn.id) is not open_turn:
            return
        open_turn.lease_timer = None
        self.release(open_turn)
        self._on_lease_expired(open_turn)

    @staticmethod
    def _cancel_lease(open_turn: OpenTurn) -> None:
        if open_turn.lease_timer is not None:
            open_turn.lease_timer.cancel()
            open_turn.lease_timer = None


def lease_of(turn_id: str, deliveries: int) -> str:
    """A lease names its turn and its delivery, so a store's record of a leased turn tells its lease."""
    return f"{turn_id}.{deliveries}"


def delivery_of(turn_id: str, lease_id: str) -> int | None:
    """The delivery a lease on this turn names; None if it is not a lease on this turn."""
    named, _, delivery = lease_id.rpartition(".")
    return int(delivery) if named == turn_id and delivery.isdigit() else None


def delivery_before_restart(turn: Turn, lease_id: str) -> int | None:
    """The delivery a lease names, if an earlier process handed it out: leases live in memory, so a turn taken back
    after a restart is parked, and a lease on it with a later delivery than this process knows can be no other.
    Its trainer's reply lands."""
    delivery = delivery_of(turn.id, lease_id)
    if turn.status is not TurnStatus.PARKED or delivery is None:
        return None
    return delivery if delivery > turn.deliveries else None


def handed_out_again(turn_id: str, lease_id: str | None) -> Conflict:
    return Conflict(
        f"lease {lease_id} on turn {turn_id} has expired and the turn was handed out again; this reply was not recorded"
    )


_DRAIN_POLL_S = 0.02
MODES = ("hold", "keep", "reject")
HOLDING = ("hold", "keep")


class Pause:
    """A pause for a weight update: new calls held or refused until `lift`."""

    def __init__(self, open_turns: OpenTurns, answer: Callable[[OpenTurn, Answerer], None]) -> None:
        self._open_turns = open_turns
        self._answer = answer  # hand a held turn to the model that answers it
        self.mode: str | None = None  # hold | keep | reject, while paused
        self._retry_after_s = 0.0
        self._held: list[tuple[OpenTurn, Answerer | None]] = []

    def start(self, mode: str, retry_after_s: float) -> None:
        if mode not in MODES:
            raise BadRequest(f"pause mode must be hold, keep or reject, not {mode!r}")
        self.mode, self._retry_after_s = mode, retry_after_s

    def lift(self) -> int:
        """Release the calls held while paused (those whose agent still waits) to the queue, or to the served
        policy that answers them; returns how many."""
        self.mode = None
        held, self._held = self._held, []
        released = [
            (open_turn, by)
            for open_turn, by in held
            if open_turn.exchanges > 0 and self._open_turns.get(open_turn.turn.id) is open_turn
        ]
        for open_turn, by in released:
            if by is None:
                self._open_turns.restore(open_turn)
            else:
                self._answer(open_turn, by)
        return len(released)

    @property
    def in_flight(self) -> int:
        """Open turns not held by the pause: parked for a trainer, leased, or being answered by a model."""
        return len(self._open_turns) - sum(
            self._open_turns.get(open_turn.turn.id) is open_turn for open_turn, _ in self._held
        )

    async def drained(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for no turn to be in flight; returns how many still are."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.in_flight and loop.time() < deadline:  # noqa: ASYNC110 (nothing announces a settling; brief)
            await asyncio.sleep(_DRAIN_POLL_S)
        return self.in_flight

    def refuse_if_rejecting(self) -> None:
        if self.mode == "reject":
            raise Paused("the trainer has paused new calls (a policy update); retry shortly", self._retry_after_s)

    def hold_if_holding(self, open_turn: OpenTurn, now: float, by: Answerer | None = None) -> bool:
        """A new call parked while paused to hold: out of the queue (or kept from the served policy `by`) until
        resume. False if not paused."""
        if self.mode not in HOLDING:
            return False
        if by is None:
            self._open_turns.withdraw(open_turn)
        else:
            self._open_turns.reserve(open_turn, now)
        self._held.append((open_turn, by))
        return True
