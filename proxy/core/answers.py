"""Answers: replies to open turns, from a trainer or from a model, each recorded before its agent hears it.

The same reply to a turn again succeeds (a trainer retrying after a lost response); a different one is a
conflict. A reply names the lease it answers, so one sent under a lease that has since expired, its turn
handed out again, is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace

from proxy.core.episodes import LiveEpisodes
from proxy.core.errors import Conflict, NotFound, TrajproxyError, TurnClosed, UpstreamError
from proxy.core.ledger import Ledger
from proxy.core.parking import ParkingLot, Slot, delivery_of
from proxy.core.ports import Store, TokenCounter, Upstream
from proxy.core.values import ModelRoute, Reply, Turn, TurnStatus, Usage

Answer = tuple[str, Reply, str | None]  # turn id, reply, the lease it answers (None: whichever holds)

_COUNT_OFF_LOOP_BYTES = 32 * 1024


class Answers:
    def __init__(
        self,
        lot: ParkingLot,
        ledger: Ledger,
        store: Store,
        tokens: TokenCounter,
        upstream: Upstream,
        episodes: LiveEpisodes,
        clock: Callable[[], float],
        *,
        lease_s: float,
    ) -> None:
        self._lot = lot
        self._ledger = ledger
        self._store = store
        self._tokens = tokens
        self._upstream = upstream
        self._lease_s = lease_s
        self._episodes = episodes
        self._now = clock
        self._pending: dict[str, asyncio.Future[None]] = {}  # turn id -> the write recording its reply
        self.policy_version: str | None = None  # what the trainer's last resume named: replies without one get it

    async def reply(self, turn_id: str, reply: Reply, lease_id: str | None = None) -> Turn:
        """Answer a turn. The same reply again succeeds; a different one is a conflict."""
        (outcome,) = await self.reply_all([(turn_id, reply, lease_id)])
        if isinstance(outcome, TrajproxyError):
            raise outcome
        return outcome

    async def reply_all(self, answers: Sequence[Answer]) -> list[Turn | TrajproxyError]:
        """Answer many turns, recording them in one write; each succeeds or fails alone."""
        outcomes: list[Turn | TrajproxyError | None] = [None] * len(answers)
        open_: list[tuple[int, Slot, Reply]] = []
        for i, (turn_id, reply, lease_id) in enumerate(answers):
            slot = self._lot.get(turn_id)
            if slot is not None and lease_id is not None and (before := _before_restart(slot.turn, lease_id)):
                slot.turn = replace(slot.turn, deliveries=before)  # the delivery its reply names is recorded
                open_.append((i, slot, reply))
            elif slot is not None and lease_id is not None and slot.turn.lease_id != lease_id:
                outcomes[i] = Conflict(
                    f"lease {lease_id} on turn {turn_id} has expired and the turn was handed out again; "
                    "this reply was not recorded"
                )
            elif slot is not None:
                open_.append((i, slot, reply))
        counted = await self._completed([(slot.turn, reply) for _, slot, reply in open_])
        now = self._now()
        answered: list[tuple[int, Slot, Turn]] = []
        for (i, slot, _), reply in zip(open_, counted, strict=True):
            turn = self._ledger.close(slot, TurnStatus.ANSWERED, None, reply=reply, answered_at=now)
            if turn is not None:  # else settled by now (an earlier answer in this batch, its agent gone, …)
                answered.append((i, slot, turn))
                if (live := self._episodes.get(turn.episode_id)) is not None:
                    live.account(turn, reply)
        if answered:
            written = asyncio.ensure_future(self._store.save_turns([turn for _, _, turn in answered]))  # noqa: RUF006 (kept in _pending)
            for _, _, turn in answered:
                self._pending[turn.id] = written
            written.add_done_callback(lambda done: self._written(answered, done))
            try:
                await asyncio.shield(written)
            except TrajproxyError as e:
                for i, _, _ in answered:
                    outcomes[i] = e
            else:
                for i, _, turn in answered:
                    outcomes[i] = turn
        unsettled = [(i, answers[i]) for i, outcome in enumerate(outcomes) if outcome is None]
        settled = await asyncio.gather(
            *(self._replied_before(turn_id, reply) for _, (turn_id, reply, _) in unsettled), return_exceptions=True
        )
        for (i, _), outcome in zip(unsettled, settled, strict=True):
            if isinstance(outcome, BaseException) and not isinstance(outcome, TrajproxyError):
                raise outcome
            outcomes[i] = outcome
        done = [outcome for outcome in outcomes if outcome is not None]
        assert len(done) == len(answers)
        return done

    async def forward(self, turn_id: str, route: ModelRoute, lease_id: str | None, lease_s: float | None) -> Turn:
        """Answer a turn from a model instead of the trainer; the turn stays leased while the model works."""
        slot = self._lot.get(turn_id)
        if slot is None:
            turn = await self._ledger.turn(turn_id)
            raise TurnClosed(f"turn {turn_id} is {turn.status}; it can no longer be answered")
        if lease_id is not None and slot.turn.lease_id != lease_id:
            raise Conflict(f"lease {lease_id} on turn {turn_id} has expired; the turn was not forwarded")
        self._lot.hold(slot, self._now())
        lease_id = slot.turn.lease_id
        try:
            reply = await self._upstream.complete(route, slot.turn.request)
        except BaseException:  # the model failed: the turn is the trainer's again, under a running lease
            self._lot.renew(slot, lease_s or self._lease_s)
            raise
        return await self.reply(turn_id, replace(reply, answered_by=route.spec), lease_id)

    def by_model(self, slot: Slot, route: ModelRoute, since: float | None = None) -> None:
        """Hold a turn out of the trainers' queue (since `since`, else now) while a model answers it."""
        self._lot.hold(slot, self._now() if since is None else since)
        self._ledger.submit(self.from_model(slot, route))

    async def from_model(self, slot: Slot, route: ModelRoute) -> None:
        """Answer a held turn from a model; if the model fails, the turn fails and its agent hears why."""
        try:
            reply = await self._upstream.complete(route, slot.turn.request)
            await self.reply(slot.turn.id, replace(reply, answered_by=route.spec), slot.turn.lease_id)
        except UpstreamError as e:
            if (failed := self._ledger.close(slot, TurnStatus.FAILED, e.message)) is not None:
                await self._store.save_turns([failed])
                slot.fail(e)
        except TurnClosed:
            pass  # the turn ended first (its agent left, or the episode finished)

    def _written(self, answered: list[tuple[int, Slot, Turn]], written: asyncio.Future[None]) -> None:
        lost = not written.cancelled() and written.exception() is not None
        failed = []
        for _, slot, turn in answered:
            self._pending.pop(turn.id, None)
            if lost:
                failed.append(replace(turn, status=TurnStatus.FAILED, reason="the reply could not be recorded"))
                self._ledger.remember(failed[-1])
            _resolve(slot, written, turn)
        if failed:
            self._ledger.submit(self._store.save_turns(failed))

    async def _replied_before(self, turn_id: str, reply: Reply) -> Turn:
        pending = self._pending.get(turn_id)
        if pending is not None:  # an answer is being recorded: judge this one against it once it is
            await asyncio.shield(pending)
        turn = await self._ledger.turn(turn_id)
        if turn.status is TurnStatus.ANSWERED:
            if turn.reply is not None and same_reply(turn.reply, reply):
                return turn
            raise Conflict(f"turn {turn_id} already has a different reply; replies cannot be changed")
        if turn.status.open:
            raise TurnClosed(f"turn {turn_id} is not waiting on this proxy any more; its agent is gone")
        raise TurnClosed(f"turn {turn_id} is {turn.status} ({turn.reason}); it can no longer be answered")

    async def _completed(self, replies: list[tuple[Turn, Reply]]) -> list[Reply]:
        """The replies as recorded: usage counted where missing, the policy version they were answered under, and
        for replies with prompt ids, whether those extend the ids of the turn their conversation continues."""
        counted = await self._with_usage(replies)
        stamped = [
            reply if reply.policy_version is not None else replace(reply, policy_version=self.policy_version)
            for reply in counted
        ]
        return [await self._chained(turn, reply) for (turn, _), reply in zip(replies, stamped, strict=True)]

    async def _chained(self, turn: Turn, reply: Reply) -> Reply:
        if reply.prompt_token_ids is None or turn.parent_id is None:
            return reply
        try:
            parent = (await self._ledger.turn(turn.parent_id)).reply
        except NotFound:
            return reply
        if parent is None or parent.prompt_token_ids is None or parent.completion_token_ids is None:
            return reply
        drift_at = first_difference(parent.prompt_token_ids + parent.completion_token_ids, reply.prompt_token_ids)
        return replace(reply, extends_parent=drift_at is None, drift_at=drift_at)

    async def _with_usage(self, replies: list[tuple[Turn, Reply]]) -> list[Reply]:
        """The replies with their usage counted where the trainer did not send it (off the loop if large)."""
        missing = [i for i, (_, reply) in enumerate(replies) if reply.usage is None and reply.message is not None]
        if not missing:
            return [reply for _, reply in replies]

        def count() -> list[Reply]:
            counted = [reply for _, reply in replies]
            for i in missing:
                turn, reply = replies[i]
                assert reply.message is not None
                usage = Usage(self._tokens.count_prompt(turn.request), self._tokens.count_completion(reply.message))
                counted[i] = replace(reply, usage=usage)
            return counted

        size = sum(len(replies[i][0].wire) for i in missing)
        loaded = all(self._tokens.ready(replies[i][0].request.get("model")) for i in missing)
        return count() if loaded and size <= _COUNT_OFF_LOOP_BYTES else await asyncio.to_thread(count)


def _before_restart(turn: Turn, lease_id: str) -> int | None:
    """The delivery a lease names, if an earlier process handed it out: leases live in memory, so a turn taken back
    after a restart is parked, and a lease on it with a later delivery than this process knows can be no other.
    Its trainer's reply lands."""
    delivery = delivery_of(turn.id, lease_id)
    if turn.status is not TurnStatus.PARKED or delivery is None:
        return None
    return delivery if delivery > turn.deliveries else None


def same_reply(recorded: Reply, offered: Reply) -> bool:
    """Whether a reply offered again is the one recorded, less what trajproxy added to it when it was recorded."""
    if offered.usage is None:
        recorded = replace(recorded, usage=None)
    if offered.policy_version is None:
        recorded = replace(recorded, policy_version=None)
    return replace(recorded, extends_parent=None, drift_at=None) == offered


def first_difference(earlier: Sequence[int], prompt: Sequence[int]) -> int | None:
    """Where a prompt stops extending an earlier turn's ids token for token; None if it extends them all."""
    for i, (mine, theirs) in enumerate(zip(earlier, prompt, strict=False)):
        if mine != theirs:
            return i
    return None if len(prompt) >= len(earlier) else len(prompt)


def _resolve(slot: Slot, written: asyncio.Future[None], turn: Turn) -> None:
    if slot.answer.done():
        return
    if written.cancelled():
        slot.answer.cancel()
    elif (error := written.exception()) is not None:
        slot.fail(error)
    else:
        slot.answer.set_result(turn)
