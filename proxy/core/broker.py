"""The broker: agents' calls become parked turns, trainers pull and answer them, every step is recorded.

Promises kept here: a turn is committed to the store before any trainer can see it, and a reply is
committed before its agent receives it. Cleanup of an open turn (answer, timeout, agent gone, episode
finished) always goes through `_close`, which settles the turn in the parking lot exactly once. A restart
loses no turn: `recover` takes back the open turns the store holds, for their agents' retries to claim.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from proxy.core.branches import Branches
from proxy.core.errors import (
    BadRequest,
    Conflict,
    EpisodeClosed,
    NotFound,
    NoTurnYet,
    OverBudget,
    Paused,
    TrajproxyError,
    TurnClosed,
    TurnTimeout,
    Unauthorized,
    UpstreamError,
)
from proxy.core.keys import hash_key, new_id, new_key, same_secret
from proxy.core.parking import ParkingLot, Slot
from proxy.core.ports import Store, TokenCounter, Upstream
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
    Usage,
)

log = logging.getLogger("trajproxy")

_RECENT_TURNS = 4096
_HUNG_UP = "the agent disconnected before a reply"
_NOT_BACK = "the proxy restarted and the agent did not come back for its turn"
_CLOSED_EPISODES = 100_000
_RETRY_LOOKBACK = 16  # an episode's latest answers a retry is matched against (more than its calls at once)
_COUNT_OFF_LOOP_BYTES = 32 * 1024

Answer = tuple[str, Reply, str | None]  # turn id, reply, the lease it answers (None: whichever holds)


@dataclass(eq=False, slots=True)
class _Live:
    """An open episode this process serves: its latest state, what it has used, its branches, and the calls
    whose turns are being written (each body by the future its write resolves)."""

    episode: Episode
    next_seq: int
    tokens: int
    branches: Branches
    recording: dict[asyncio.Future[None], bytes] = field(default_factory=dict)


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
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._tokens = tokens
        self._upstream = upstream
        self._turn_timeout_s = turn_timeout_s
        self._lease_s = lease_s
        self._retry_grace_s = retry_grace_s
        self._now = clock
        self._lot = ParkingLot(on_lease_expired=self._lease_expired)
        self._live: dict[str, _Live] = {}
        self._live_by_key: dict[str, _Live] = {}
        self._closed: OrderedDict[str, Episode] = OrderedDict()  # tombstones: a stale read cannot reopen these
        self._pending_replies: dict[str, asyncio.Future[None]] = {}
        self._last_answered: dict[str, Turn] = {}  # per open episode: what an SDK retry may need replayed
        self._arguments: dict[str, dict[str, str]] = {}  # per open episode: tool call id -> arguments as sent
        self._pause: tuple[str, float] | None = None  # (hold | reject, retry-after seconds) while paused
        self._held: list[Slot] = []
        self._recent: OrderedDict[str, Turn] = OrderedDict()
        self._background: set[asyncio.Future[Any]] = set()

    @property
    def open_turns(self) -> int:
        return len(self._lot)

    @property
    def ready_turns(self) -> int:
        return self._lot.ready_count

    @property
    def waiting_pollers(self) -> int:
        return self._lot.poller_count

    @property
    def paused(self) -> str | None:
        return self._pause[0] if self._pause else None

    def pause(self, mode: str, retry_after_s: float) -> None:
        """Stop handing out new agent calls (for a weight update) while turns already pulled or parked drain:
        `hold` parks new calls out of the queue until `resume`; `reject` answers them 429 with Retry-After."""
        if mode not in ("hold", "reject"):
            raise BadRequest(f"pause mode must be hold or reject, not {mode!r}")
        self._pause = (mode, retry_after_s)

    def resume(self) -> int:
        """Release the calls held while paused; returns how many go to the queue."""
        self._pause = None
        held, self._held = self._held, []
        released = [slot for slot in held if slot.exchanges > 0 and self._lot.get(slot.turn.id) is slot]
        for slot in released:
            self._lot.restore(slot)
        return len(released)

    async def drain(self) -> None:
        """Wait for the background writes submitted so far (state changes nobody awaited) to be committed."""
        if pending := list(self._background):
            await asyncio.wait(pending)

    async def recover(self) -> int:
        """Take back the open turns a previous process left in the store (it stopped or crashed holding them);
        call once, at start-up, before serving. Returns how many it took back.

        Their agents' connections died with that process, so each waits out of the queue, as a turn whose agent
        hung up does: its agent's SDK retry (the same body) reattaches to it within the retry grace, or it is
        recorded abandoned. A leased one keeps its lease (renewed), so the reply its trainer sends still lands;
        answered before the retry comes, it is replayed to the retry. A turn a model answers goes to it again.
        """
        left: dict[str, list[Turn]] = {}
        for turn in await self._store.open_turns():
            left.setdefault(turn.episode_id, []).append(turn)
        lives = await asyncio.gather(*(self._live_episode(episode_id) for episode_id in left))
        loop, now = asyncio.get_running_loop(), self._now()
        closed: list[Turn] = []
        for live, turns in zip(lives, left.values(), strict=True):
            if live is None:  # its episode closed, and the record of its turns closing was lost with the process
                closed += [
                    replace(turn, status=TurnStatus.FAILED, ended_at=now, reason="episode closed") for turn in turns
                ]
                continue
            for turn in turns:
                slot = self._lot.adopt(turn, self._lease_s)
                slot.grace_timer = loop.call_later(self._retry_grace_s, self._abandon, slot, _NOT_BACK)
                if (answerer := self._route(live, turn.request) or live.episode.policy) is not None:
                    self._lot.hold(slot, now)
                    self._submit(self._answer_from(slot, answerer))
        await self._store.save_turns(closed)
        taken = sum(map(len, left.values())) - len(closed)
        if left:
            log.info("took back %d open turns of %d episodes from the store", taken, len(left))
        return taken

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
        self._remember(episode, Tally())
        return episode, key

    async def authenticate(self, key: str | None) -> Episode:
        if not key:
            raise Unauthorized(
                "missing episode key: send it as 'Authorization: Bearer <key>', as 'x-api-key: <key>', "
                "or in the path as /e/<key>/v1/..."
            )
        key_hash = hash_key(key)
        live = self._live_by_key.get(key_hash)
        episode = live.episode if live else await self._store.episode_by_key_hash(key_hash)
        if episode is None or not same_secret(episode.key_hash, key_hash):
            raise Unauthorized("unknown episode key: create an episode with POST /api/episodes and use its key")
        if live is None and not episode.status.closed:
            await self._live_episode(episode.id)
        return episode

    async def episode(self, episode_id: str) -> Episode:
        live = self._live.get(episode_id)
        episode = live.episode if live else self._closed.get(episode_id) or await self._store.episode(episode_id)
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
        live = await self._live_episode(episode_id)
        if live is None:
            episode = await self.episode(episode_id)
            if episode.status is status:
                return episode
            raise Conflict(f"episode {episode_id} is already {episode.status}; it cannot become {status}")
        episode = replace(live.episode, status=status, reason=reason, ended_at=self._now())
        if over_budget is not None:
            episode = replace(episode, over_budget=over_budget)
        live.episode = episode  # in-flight calls of this episode see it closed from now on
        self._bury(episode)
        self._lot.wake(episode_id)  # a trainer stepping through this episode learns it has ended
        why = f"episode {episode_id} is {status}" + (f": {reason}" if reason else "")
        slots = self._lot.of_episode(episode_id)
        closed = [turn for slot in slots if (turn := self._close(slot, TurnStatus.FAILED, why))]
        try:
            await asyncio.gather(self._store.save_episode(episode), self._store.save_turns(closed))
        finally:
            for slot in slots:
                _fail(slot.answer, EpisodeClosed(why))
        return episode

    # Agent side

    async def park(
        self, episode_id: str, dialect: str, request: JsonObject, wire: bytes, *, stream: bool, retry: bool = False
    ) -> Slot:
        """Record the agent's call as a new turn and park it for a trainer to pull.

        An SDK's retry (`retry`) of a call whose turn is still open attaches to that turn, and a retry of the
        episode's last answered call gets its recorded reply again: a retry never becomes a second turn.
        """
        live = await self._live_episode(episode_id)
        if live is None:
            raise self._closed_error(await self.episode(episode_id))
        if retry and (same := await self._retried(live, wire)) is not None:
            return same
        if self._pause is not None and self._pause[0] == "reject":
            raise Paused("the trainer has paused new calls (a policy update); retry shortly", self._pause[1])
        now = self._now()
        if (over := live.episode.budget.exceeded(live.next_seq, live.tokens, now)) is not None:
            await self._over_budget(live, over)
        model = request.get("model")
        self._restore_arguments(episode_id, request)
        route = self._route(live, request)
        turn_id = new_id("tu")
        branch, parent_id = live.branches.place(turn_id, request)
        turn = Turn(
            id=turn_id,
            episode_id=episode_id,
            seq=live.next_seq,
            dialect=dialect,
            request=request,
            wire=wire,
            stream=stream,
            status=TurnStatus.PARKED,
            created_at=now,
            model=model if isinstance(model, str) else None,
            trainable=route is None,
            branch=branch,
            parent_id=parent_id,
        )
        live.next_seq += 1
        if live.episode.status is EpisodeStatus.PENDING:
            live.episode = replace(live.episode, status=EpisodeStatus.RUNNING, started_at=now)
            self._submit(self._store.save_episode(live.episode))
        recorded = asyncio.get_running_loop().create_future()
        live.recording[recorded] = wire
        try:
            await self._store.add_turn(turn)
        finally:  # a retry of this call that came meanwhile finds the turn in the lot once it resumes
            del live.recording[recorded]
            recorded.set_result(None)
        if live.episode.status.closed:
            failed = replace(turn, status=TurnStatus.FAILED, ended_at=self._now(), reason="episode closed")
            self._submit(self._store.save_turns([failed]))
            raise self._closed_error(live.episode)
        slot = self._lot.park(turn)
        if (answerer := route or live.episode.policy) is not None:  # a model answers: no trainer sees the turn
            self._lot.hold(slot, now)
            self._submit(self._answer_from(slot, answerer))
        elif self._pause is not None:  # held: out of the queue until resume (its stream gets keep-alives)
            self._lot.withdraw(slot)
            self._held.append(slot)
        return slot

    async def _over_budget(self, live: _Live, why: str) -> None:
        """Refuse a call over the episode's budget (429), or finish the episode if its budget says so (410)."""
        episode = live.episode
        if episode.budget.finish:
            await self.finish(episode.id, EpisodeStatus.FINISHED, why, over_budget=why)
            raise self._closed_error(await self.episode(episode.id))
        if episode.over_budget != why:
            live.episode = replace(episode, over_budget=why)
            await self._store.save_episode(live.episode)
        raise OverBudget(f"episode {episode.id} is {why}; it takes no more calls")

    async def _answer_from(self, slot: Slot, route: ModelRoute) -> None:
        """Answer a held turn from a model; if the model fails, the turn fails and its agent hears why."""
        try:
            reply = await self._upstream.complete(route.model, slot.turn.request, route.options)
            await self.reply(slot.turn.id, replace(reply, answered_by=f"model:{route.model}"), slot.turn.lease_id)
        except UpstreamError as e:
            if (failed := self._close(slot, TurnStatus.FAILED, e.message)) is not None:
                await self._store.save_turns([failed])
                _fail(slot.answer, e)
        except TurnClosed:
            pass  # the turn ended first (its agent left, or the episode finished)

    def expire_later(self, slot: Slot, episode: Episode) -> asyncio.TimerHandle:
        """Start the turn timeout of an agent exchange waiting on `slot.answer`: if no reply has come when it
        passes, the turn is recorded as expired and every exchange waiting on it hears TurnTimeout. The
        exchange cancels the returned timer when it ends."""
        timeout_s = episode.turn_timeout_s or self._turn_timeout_s
        return asyncio.get_running_loop().call_later(timeout_s, self._expire, slot, timeout_s)

    def _expire(self, slot: Slot, timeout_s: float) -> None:
        expired = self._close(slot, TurnStatus.EXPIRED, f"no reply within the turn timeout of {timeout_s:g} s")
        if expired is None:  # answered (or closed) at the last moment: its answer is on the way
            return
        why = f"no reply to turn {slot.turn.id} within {timeout_s:g} s; the turn is recorded as expired"

        def tell(_written: asyncio.Future[None]) -> None:
            _fail(slot.answer, TurnTimeout(why))

        # The agent hears of it once the expiry is recorded (or has failed to be).
        self._submit(self._store.save_turns([expired])).add_done_callback(tell)

    def leave(self, slot: Slot) -> None:
        """An agent exchange ended. If it was the turn's last and the turn is unanswered, the turn leaves the
        queue at once (no trainer receives it afterwards) and is abandoned unless a retry comes back for it
        within the retry grace."""
        slot.exchanges -= 1
        if slot.exchanges > 0 or self._lot.get(slot.turn.id) is not slot:
            return
        self._lot.withdraw(slot)
        slot.grace_timer = asyncio.get_running_loop().call_later(self._retry_grace_s, self._abandon, slot, _HUNG_UP)

    def _abandon(self, slot: Slot, why: str) -> None:
        abandoned = self._close(slot, TurnStatus.ABANDONED, why)
        if abandoned is not None:
            self._submit(self._store.save_turns([abandoned]))

    def _restore_arguments(self, episode_id: str, request: JsonObject) -> None:
        """Give tool calls the agent sends back the exact arguments string the trainer sent, where the agent's
        dialect carries arguments as a JSON object (Anthropic) and so re-serialised them: the trainer's history
        then holds the very text its policy produced."""
        sent = self._arguments.get(episode_id)
        if not sent:
            return
        for message in request.get("messages") or ():
            for call in (message.get("tool_calls") or ()) if isinstance(message, dict) else ():
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict):
                    continue
                original, echoed = sent.get(call.get("id")), function.get("arguments")
                if original is not None and original != echoed and _same_json(original, echoed):
                    function["arguments"] = original

    async def _retried(self, live: _Live, wire: bytes) -> Slot | None:
        """The turn an SDK retry with this exact body belongs to: still open (or still being written), or
        answered, its reply lost on the way (the agent hung up, or the proxy stopped before sending it); the
        retry then gets that reply again."""
        for write in [write for write, body in live.recording.items() if body == wire]:
            await asyncio.shield(write)
        episode_id = live.episode.id
        for slot in self._lot.of_episode(episode_id):
            if slot.turn.wire == wire:
                slot.exchanges += 1
                if slot.grace_timer is not None:
                    slot.grace_timer.cancel()
                    slot.grace_timer = None
                self._lot.restore(slot)
                return slot
        answered = self._last_answered.get(episode_id)
        if answered is None or answered.wire != wire:  # not the last answer this process gave: ask the store
            latest = await self._store.latest_answered(episode_id, _RETRY_LOOKBACK)
            answered = next((turn for turn in latest if turn.wire == wire), None)
            if answered is None:
                return None
        replay = Slot(answered, asyncio.get_running_loop().create_future())
        replay.answer.set_result(answered)
        return replay

    def count_tokens(self, request: JsonObject) -> int:
        """The prompt tokens of a chat request, as replies count them (for count_tokens endpoints)."""
        return self._tokens.count_prompt(request)

    # Trainer side

    async def pull(self, episode_id: str | None, max_turns: int, wait_s: float, lease_s: float | None) -> list[Turn]:
        """Lease up to `max_turns` parked turns, waiting up to `wait_s` for the first one (no longer than the
        episode, if one is named, stays open)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not (slots := self._lot.take(episode_id, max_turns, lease_s or self._lease_s, self._now())):
            remaining = deadline - loop.time()
            if remaining <= 0 or episode_id in self._closed:
                return []
            await self._lot.wait(episode_id, remaining)
        turns = [slot.turn for slot in slots]
        try:
            await asyncio.shield(self._store.save_turns(turns))
        except BaseException:  # the poller left, or the lease could not be recorded: give the turns back
            self.release(turns)
            raise
        # A turn settled while its lease was being recorded (agent gone, episode finished) is not handed out.
        return [turn for slot, turn in zip(slots, turns, strict=True) if self._lot.get(turn.id) is slot]

    def release(self, turns: Sequence[Turn]) -> None:
        """Give back leased turns whose poller went away before receiving them."""
        for turn in turns:
            slot = self._lot.get(turn.id)
            if slot is not None and slot.turn.lease_id == turn.lease_id:
                self._lot.release(slot)
                self._submit(self._store.save_turns([slot.turn]))

    async def next_turn(self, episode_id: str, wait_s: float, lease_s: float | None) -> Turn | None:
        """Lease the episode's next turn, waiting up to `wait_s` for its agent to call; None once the episode
        has ended with nothing left to answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not (turns := await self.pull(episode_id, 1, max(0.0, deadline - loop.time()), lease_s)):
            if (await self.episode(episode_id)).status.closed:
                return None
            if loop.time() >= deadline:
                raise NoTurnYet(
                    f"episode {episode_id}'s agent made no call within {wait_s:g} s and is still running; "
                    "ask again to keep waiting"
                )
        return turns[0]

    async def reply(self, turn_id: str, reply: Reply, lease_id: str | None = None) -> Turn:
        """Answer a turn. The same reply again succeeds; a different one is a conflict."""
        (outcome,) = await self.reply_all([(turn_id, reply, lease_id)])
        if isinstance(outcome, TrajproxyError):
            raise outcome
        return outcome

    async def reply_all(self, answers: Sequence[Answer]) -> list[Turn | TrajproxyError]:
        """Answer many turns (`reply` for each), recording them in one write; each succeeds or fails alone."""
        outcomes: list[Turn | TrajproxyError | None] = [None] * len(answers)
        open_: list[tuple[int, Slot, Reply]] = []
        for i, (turn_id, reply, lease_id) in enumerate(answers):
            slot = self._lot.get(turn_id)
            if slot is not None and lease_id is not None and slot.turn.lease_id != lease_id:
                outcomes[i] = Conflict(
                    f"lease {lease_id} on turn {turn_id} has expired and the turn was handed out again; "
                    "this reply was not recorded"
                )
            elif slot is not None:
                open_.append((i, slot, reply))
        counted = await self._with_usage([(slot.turn, reply) for _, slot, reply in open_])
        now = self._now()
        answered: list[tuple[int, Slot, Turn]] = []
        for (i, slot, _), reply in zip(open_, counted, strict=True):
            turn = self._close(slot, TurnStatus.ANSWERED, None, reply=reply, answered_at=now)
            if turn is not None:  # else settled by now (an earlier answer in this batch, its agent gone, …)
                answered.append((i, slot, turn))
                self._account(turn, reply)
        if answered:
            written = asyncio.ensure_future(self._store.save_turns([turn for _, _, turn in answered]))  # noqa: RUF006 (kept in _pending_replies)
            for _, _, turn in answered:
                self._pending_replies[turn.id] = written
            written.add_done_callback(lambda done: self._replies_written(answered, done))
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

    def _account(self, turn: Turn, reply: Reply) -> None:
        """What an answered turn adds to its live episode: tokens used, the retry replay, the arguments sent."""
        if (live := self._live.get(turn.episode_id)) is None:
            return
        live.tokens += reply.usage.total_tokens if reply.usage else 0
        self._last_answered[turn.episode_id] = turn
        sent = self._arguments.setdefault(turn.episode_id, {})
        for call in (reply.message or {}).get("tool_calls") or ():
            sent[call["id"]] = call["function"]["arguments"]

    async def forward(
        self, turn_id: str, model: str, options: JsonObject, lease_id: str | None = None, lease_s: float | None = None
    ) -> Turn:
        """Answer a turn from a model instead of the trainer; the turn stays leased while the model works."""
        slot = self._lot.get(turn_id)
        if slot is None:
            turn = await self.turn(turn_id)
            raise TurnClosed(f"turn {turn_id} is {turn.status}; it can no longer be answered")
        if lease_id is not None and slot.turn.lease_id != lease_id:
            raise Conflict(f"lease {lease_id} on turn {turn_id} has expired; the turn was not forwarded")
        self._lot.hold(slot, self._now())
        lease_id = slot.turn.lease_id
        try:
            reply = await self._upstream.complete(model, slot.turn.request, options)
        except BaseException:  # the model failed: the turn is the trainer's again, under a running lease
            self._lot.renew(slot, lease_s or self._lease_s)
            raise
        return await self.reply(turn_id, replace(reply, answered_by=f"model:{model}"), lease_id)

    async def add_reward(
        self,
        episode_id: str,
        name: str,
        value: float,
        *,
        source: str,
        info: JsonObject,
        turn_id: str | None = None,
    ) -> Reward:
        if not math.isfinite(value):
            raise BadRequest(f"reward {name!r} must be a finite number, not {value}")
        await self.episode(episode_id)
        if turn_id is not None:
            turn = await self.turn(turn_id)
            if turn.episode_id != episode_id:
                raise NotFound(f"episode {episode_id} has no turn {turn_id!r}")
        reward = Reward(
            id=new_id("rw"),
            episode_id=episode_id,
            name=name,
            value=value,
            source=source,
            created_at=self._now(),
            turn_id=turn_id,
            info=info,
        )
        await self._store.add_reward(reward)
        return reward

    async def turn(self, turn_id: str) -> Turn:
        slot = self._lot.get(turn_id)
        turn = slot.turn if slot else self._recent.get(turn_id) or await self._store.turn(turn_id)
        if turn is None:
            raise NotFound(f"no turn {turn_id!r}")
        return turn

    async def rewards(self, episode_id: str) -> list[Reward]:
        await self.episode(episode_id)
        return await self._store.rewards(episode_id)

    async def trajectory(self, episode_id: str) -> tuple[Episode, list[Turn], list[Reward]]:
        episode = await self.episode(episode_id)
        await self.drain()
        turns, rewards = await asyncio.gather(self._store.turns(episode_id), self._store.rewards(episode_id))
        return episode, turns, rewards

    # Internals

    def _close(self, slot: Slot, status: TurnStatus, reason: str | None, **changes: Any) -> Turn | None:
        """Settle an open turn once, whatever ended it; None if something else settled it first."""
        if self._lot.settle(slot.turn.id) is None:
            return None
        turn = replace(slot.turn, status=status, reason=reason, ended_at=self._now(), lease_id=None, **changes)
        slot.turn = turn
        self._recent[turn.id] = turn
        if len(self._recent) > _RECENT_TURNS:
            self._recent.popitem(last=False)
        return turn

    async def _replied_before(self, turn_id: str, reply: Reply) -> Turn:
        pending = self._pending_replies.get(turn_id)
        if pending is not None:  # an answer is being recorded: judge this one against it once it is
            await asyncio.shield(pending)
        turn = await self.turn(turn_id)
        if turn.status is TurnStatus.ANSWERED:
            if turn.reply is not None and _same_reply(turn.reply, reply):
                return turn
            raise Conflict(f"turn {turn_id} already has a different reply; replies cannot be changed")
        if turn.status.open:
            raise TurnClosed(f"turn {turn_id} is not waiting on this proxy any more; its agent is gone")
        raise TurnClosed(f"turn {turn_id} is {turn.status} ({turn.reason}); it can no longer be answered")

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
        return await asyncio.to_thread(count) if size > _COUNT_OFF_LOOP_BYTES else count()

    async def _live_episode(self, episode_id: str) -> _Live | None:
        """The live state of an open episode, loaded from the store if this process has not seen it."""
        live = self._live.get(episode_id)
        if live is not None or episode_id in self._closed:
            return live if live is not None and not live.episode.status.closed else None
        episode = await self._store.episode(episode_id)
        if episode is None or episode.status.closed:
            return None
        tally = await self._store.tally(episode_id)
        if episode_id in self._closed:  # finished while we were reading the store
            return None
        return self._live.get(episode_id) or self._remember(episode, tally)

    def _replies_written(self, answered: list[tuple[int, Slot, Turn]], written: asyncio.Future[None]) -> None:
        lost = not written.cancelled() and written.exception() is not None
        failed = []
        for _, slot, turn in answered:
            self._pending_replies.pop(turn.id, None)
            if lost:
                failed.append(replace(turn, status=TurnStatus.FAILED, reason="the reply could not be recorded"))
                self._recent[turn.id] = failed[-1]
            _resolve(slot.answer, written, turn)
        if failed:
            self._submit(self._store.save_turns(failed))

    def _bury(self, episode: Episode) -> None:
        """Forget a closed episode's live state, keeping a tombstone so no stale read revives it."""
        self._live.pop(episode.id, None)
        self._live_by_key.pop(episode.key_hash, None)
        self._last_answered.pop(episode.id, None)
        self._arguments.pop(episode.id, None)
        self._closed[episode.id] = episode
        if len(self._closed) > _CLOSED_EPISODES:
            self._closed.popitem(last=False)

    def _remember(self, episode: Episode, tally: Tally) -> _Live:
        live = _Live(episode, tally.next_seq, tally.tokens, Branches(tally.next_branch))
        self._live[episode.id] = live
        self._live_by_key[episode.key_hash] = live
        return live

    def _lease_expired(self, slot: Slot) -> None:
        log.info("lease on turn %s expired; it is back in the queue", slot.turn.id)
        self._submit(self._store.save_turns([slot.turn]))

    def _submit(self, write: Awaitable[None]) -> asyncio.Future[None]:
        future = asyncio.ensure_future(write)
        self._background.add(future)
        future.add_done_callback(self._written)
        return future

    def _written(self, future: asyncio.Future[Any]) -> None:
        self._background.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.error("a background write failed", exc_info=future.exception())

    @staticmethod
    def _route(live: _Live, request: JsonObject) -> ModelRoute | None:
        """The episode's routing rule that sends this call to a model, if one does."""
        return next((route for route in live.episode.routes if route.matches(request)), None)

    @staticmethod
    def _closed_error(episode: Episode) -> EpisodeClosed:
        why = f": {episode.reason}" if episode.reason else ""
        return EpisodeClosed(f"episode {episode.id} is {episode.status}{why}; it takes no more calls")


def _same_json(a: object, b: object) -> bool:
    try:
        return isinstance(a, str) and isinstance(b, str) and json.loads(a) == json.loads(b)
    except ValueError:
        return False


def _same_reply(recorded: Reply, offered: Reply) -> bool:
    if offered.usage is None:
        recorded = replace(recorded, usage=None)
    return recorded == offered


def _resolve(answer: asyncio.Future[Turn], written: asyncio.Future[None], turn: Turn) -> None:
    if answer.done():
        return
    if written.cancelled():
        answer.cancel()
    elif (error := written.exception()) is not None:
        _fail(answer, error)
    else:
        answer.set_result(turn)


def _fail(answer: asyncio.Future[Turn], error: BaseException) -> None:
    """Fail a turn's answer for the agent exchanges waiting on it; its agent may be gone, so none may ever look
    (the error counts as seen, or asyncio would log it as never retrieved)."""
    if not answer.done():
        answer.set_exception(error)
        answer.exception()
