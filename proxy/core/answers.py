"""Answers: replies to open turns, from a trainer or from a model, each recorded before its agent hears it.

The same reply to a turn again succeeds (a trainer retrying after a lost response); a different one is a
conflict. A reply names the lease it answers, so one sent under a lease that has since expired, its turn
handed out again, is refused. Where a reply is checked against its turn and recorded is the queue's `Replies`: this
process's open turns and store, or the database replicas share; everything else about answering is here.

`LocalQueue` is the queue of a process that is its database's only one: its open turns are the queue. A pull leases
from them, waiting for a turn if none is ready; a lease lives in memory only, costing no write: after a restart its
turn is parked again, and a reply naming it still lands (`delivery_before_restart`). A reply is checked against the
open turns and recorded in the store before its agent hears it (`LocalReplies`). A restart loses no turn: `start`
takes back the open turns the store holds, for their agents' retries to find.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from proxy.core.chunks import Body
from proxy.core.context import Context
from proxy.core.endings import UNRECORDED
from proxy.core.episodes import LiveEpisode
from proxy.core.errors import Conflict, NotFound, StorageError, TrajproxyError, TurnClosed, UpstreamError
from proxy.core.open_turns import OpenTurn, Pause, delivery_before_restart, handed_out_again
from proxy.core.prefixes import extension_of
from proxy.core.recovery import adopt, left_open
from proxy.core.retries import lost_reply, retried
from proxy.core.values import Answerer, Reply, Turn, TurnStatus, Usage

log = logging.getLogger("trajproxy")

Answer = tuple[str, Reply, str | None]  # turn id, reply, the lease it answers (None: whichever holds)
Outcome = Turn | TrajproxyError

_COUNT_OFF_LOOP_BYTES = 32 * 1024


@dataclass(frozen=True, slots=True)
class Target:
    """What an answer answers: its turn as it stands, open under the lease the answer names."""

    turn: Turn
    open_turn: OpenTurn | None = None  # the turn as this process has it open, if it does
    delivery: int | None = None  # the delivery its lease names, where the lease is not this process's own


class Replies(Protocol):
    """Where replies meet their turns: each checked against the turn's lease, recorded once, or checked as a repeat."""

    async def targets(self, answers: Sequence[Answer]) -> list[Target | TrajproxyError | None]:
        """For each answer: its target (the open turn it answers), why it has none, or None (not open here:
        `check_repeat` it)."""
        ...

    async def record(self, targets: Sequence[tuple[Target, Reply]], now: float) -> list[Outcome | None]:
        """Record the reply to each target (completed); for each, the turn answered, why it failed, or None if another
        answer settled the turn first (`check_repeat` it)."""
        ...

    async def check_repeat(self, turn_id: str, reply: Reply) -> Turn:
        """An answer that found its turn not open under its lease: the same reply again succeeds, else why not."""
        ...

    async def forwarding(self, turn_id: str, lease_id: str | None) -> tuple[Turn, str | None, Callable[[float], None]]:
        """A turn about to be answered by a model for its trainer (open under `lease_id`): the turn, the lease its
        answer names, and what gives the trainer its lease back (for this many seconds) if the model fails."""
        ...


class Answers:
    def __init__(self, *, context: Context, replies: Replies) -> None:
        self._context = context
        self._replies = replies
        self._policy_version: str | None = None
        self.versions: list[str] = []  # every policy version named, oldest first

    @property
    def policy_version(self) -> str | None:
        """What the trainer's last resume named: replies without a version of their own get it."""
        return self._policy_version

    @policy_version.setter
    def policy_version(self, version: str | None) -> None:
        self._policy_version = version
        if version is not None and version not in self.versions:
            self.versions.append(version)

    async def reply(self, turn_id: str, reply: Reply, lease_id: str | None = None) -> Turn:
        """Answer a turn. The same reply again succeeds; a different one is a conflict."""
        (outcome,) = await self.reply_all([(turn_id, reply, lease_id)])
        if isinstance(outcome, TrajproxyError):
            raise outcome
        return outcome

    async def reply_all(self, answers: Sequence[Answer]) -> list[Outcome]:
        """Answer many turns, recording them in one write; each succeeds or fails alone."""
        targets = await self._replies.targets(answers)
        outcomes: list[Outcome | None] = [target if isinstance(target, TrajproxyError) else None for target in targets]
        open_ = [(i, target) for i, target in enumerate(targets) if isinstance(target, Target)]
        completed = await self._completed([(target.turn, answers[i][1]) for i, target in open_])
        to_record = [(target, reply) for (_, target), reply in zip(open_, completed, strict=True)]
        recorded = await self._replies.record(to_record, self._context.clock())
        for (i, _), outcome in zip(open_, recorded, strict=True):
            outcomes[i] = outcome
        unsettled = [i for i, outcome in enumerate(outcomes) if outcome is None]
        repeats = await asyncio.gather(
            *(self._replies.check_repeat(answers[i][0], answers[i][1]) for i in unsettled), return_exceptions=True
        )
        for i, verdict in zip(unsettled, repeats, strict=True):
            if isinstance(verdict, BaseException) and not isinstance(verdict, TrajproxyError):
                raise verdict
            outcomes[i] = verdict
        done = [outcome for outcome in outcomes if outcome is not None]
        assert len(done) == len(answers)
        return done

    async def forward(self, turn_id: str, answerer: Answerer, lease_id: str | None, lease_s: float | None) -> Turn:
        """Answer a turn from a model instead of the trainer; the turn stays leased while the model works."""
        turn, lease_id, give_back = await self._replies.forwarding(turn_id, lease_id)
        version = self.policy_version
        try:
            reply = await self._context.upstream.complete(answerer, turn.request, await self._parent(turn))
        except BaseException:  # the model failed: the turn is the trainer's again, under a running lease
            give_back(lease_s or self._context.lease_s)
            raise
        return await self.reply(turn_id, _sent_under(reply, answerer, version), lease_id)

    def by_model(self, open_turn: OpenTurn, answerer: Answerer, since: float | None = None) -> None:
        """Reserve a turn (leased with no expiry, out of the trainers' queue, since `since`, else now) while a model
        answers it."""
        context = self._context
        context.open_turns.reserve(open_turn, context.clock() if since is None else since)
        context.endings.answering(self._from_model(open_turn, answerer))

    async def _from_model(self, open_turn: OpenTurn, answerer: Answerer) -> None:
        """Answer a reserved turn from a model; if the model fails, the turn fails and its agent hears why."""
        version = self.policy_version
        try:
            reply = await self._context.upstream.complete(
                answerer, open_turn.turn.request, await self._parent(open_turn.turn)
            )
        except UpstreamError as e:
            self._context.endings.end([open_turn], TurnStatus.FAILED, e.message, e)
            return
        except (
            Exception
        ) as e:  # a fault in making the answer (a template, a parser): the agent hears now, not at its timeout
            log.exception("turn %s: answering it from %s failed", open_turn.turn.id, answerer.kind)
            failed = UpstreamError(
                f"the policy's answer could not be made ({type(e).__name__}); the server's log says more"
            )
            self._context.endings.end([open_turn], TurnStatus.FAILED, failed.message, failed)
            return
        await self.answer_reserved(open_turn, _sent_under(reply, answerer, version))

    async def answer_reserved(self, open_turn: OpenTurn, reply: Reply) -> None:
        """Answer a turn reserved out of the queue (a model's reply, a fork's replay); if the reply cannot be recorded,
        the turn fails and its agent hears why."""
        try:
            await self.reply(open_turn.turn.id, reply, open_turn.turn.lease_id)
        except StorageError as e:  # where the turn is still open here (the database replicas share refused it)
            self._context.endings.end([open_turn], TurnStatus.FAILED, UNRECORDED, e)
        except TurnClosed:
            pass  # the turn ended first (its agent left, or the episode finished)

    async def _completed(self, replies: list[tuple[Turn, Reply]]) -> list[Reply]:
        """The replies as recorded: usage counted where missing, the policy version they were answered under, and
        for replies with prompt ids, whether those extend the ids of the turn their conversation continues."""
        counted = await self._with_usage(replies)
        version = self.policy_version
        stamped = [
            replace(reply, policy_version=version) if reply.policy_version is None and version is not None else reply
            for reply in counted
        ]
        for reply in stamped:  # a version a reply names (the trainer's engine said which weights sampled) is named too
            if reply.policy_version is not None and reply.policy_version not in self.versions:
                self.versions.append(reply.policy_version)
        return [await self._chained(turn, reply) for (turn, _), reply in zip(replies, stamped, strict=True)]

    async def _parent(self, turn: Turn) -> Turn | None:
        """The turn whose conversation this one continues, if it is still known."""
        if turn.parent_id is None:
            return None
        try:
            return await self._context.endings.turn(turn.parent_id)
        except NotFound:
            return None

    async def _chained(self, turn: Turn, reply: Reply) -> Reply:
        if reply.prompt_token_ids is None or turn.parent_id is None or reply.extends_parent is not None:
            return reply  # (a served policy in tokens mode builds its prompt from its parent's ids: it says so)
        found = await self._parent(turn)
        parent = found.reply if found is not None else None
        if parent is None or parent.prompt_token_ids is None or parent.completion_token_ids is None:
            return reply
        drift_at = extension_of(parent.prompt_token_ids, parent.completion_token_ids, reply.prompt_token_ids)
        return replace(reply, extends_parent=drift_at is None, drift_at=drift_at)

    async def _with_usage(self, replies: list[tuple[Turn, Reply]]) -> list[Reply]:
        """The replies with their usage counted where the trainer did not send it (off the loop if large)."""
        missing = [i for i, (_, reply) in enumerate(replies) if reply.usage is None and reply.message is not None]
        if not missing:
            return [reply for _, reply in replies]
        tokens = self._context.tokens

        def count() -> list[Reply]:
            counted = [reply for _, reply in replies]
            for i in missing:
                turn, reply = replies[i]
                assert reply.message is not None
                usage = Usage(tokens.count_prompt(turn.request), tokens.count_completion(reply.message))
                counted[i] = replace(reply, usage=usage)
            return counted

        size = sum(len(replies[i][0].wire) for i in missing)
        loaded = all(tokens.ready(replies[i][0].request.get("model")) for i in missing)
        return count() if loaded and size <= _COUNT_OFF_LOOP_BYTES else await asyncio.to_thread(count)


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

    async def retried(self, live: LiveEpisode, wire: Body) -> OpenTurn | None:
        return await retried(self._context.open_turns, self._context.store, live, wire)

    async def unmarked_retry(self, live: LiveEpisode, wire: Body) -> OpenTurn | None:
        return await lost_reply(self._context.store, live, wire)

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
            if (
                open_turn is not None
                and lease_id is not None
                and (before := delivery_before_restart(open_turn.turn, lease_id))
            ):
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


def _sent_under(reply: Reply, answerer: Answerer, version: str | None) -> Reply:
    """A model's reply, named for its model and for the policy version its call was sent under: a call in flight
    while the trainer resumes with new weights was answered by the old ones (`pause` mode `keep`)."""
    return replace(reply, answered_by=answerer.spec, policy_version=reply.policy_version or version)


def same_reply(recorded: Reply, offered: Reply) -> bool:
    """Whether a reply offered again is the one recorded, less what trajproxy added to it when it was recorded."""
    if offered.usage is None:
        recorded = replace(recorded, usage=None)
    if offered.policy_version is None:
        recorded = replace(recorded, policy_version=None)
    return replace(recorded, extends_parent=None, drift_at=None) == offered
