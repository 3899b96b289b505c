"""How open turns end: each exactly once, whatever ends it (`Endings.settle`), the turns ended lately kept at hand,
the writes nobody waits on; and the deadlines that end a turn nobody answers or nobody comes back for, which
an agent's exchange on its turn starts and leaves (`Attendance`).

A turn whose agent hung up leaves the queue at once and waits the retry grace for its SDK's retry (the same
body) to come back for it; one taken back after a restart waits the restart grace, longer, since its agent's
SDK may be deep in its backoff by then. A turn no retry comes back for is recorded abandoned.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

from proxy.core.errors import NotFound, TrajproxyError, TurnClosed, TurnTimeout
from proxy.core.ids import TokenIds
from proxy.core.observer import Observer, Unobserved
from proxy.core.open_turns import OpenTurn, OpenTurns
from proxy.core.ports import Store
from proxy.core.values import Episode, Turn, TurnStatus

log = logging.getLogger("trajproxy")

# The settled turns kept at hand once recorded: the newest 4,096, fewer when their calls are large (a coding agent's
# call can be a megabyte, and the fuzzers sent 16 MiB ones), within about 128 MiB of what they hold. A turn whose
# write is still on its way is kept besides, whatever its size, until the store has it.
_RECENT_TURNS = 4096
_RECENT_BYTES = 128 * 2**20
_BYTES_PER_ID = 36  # a token id or logprob held in a tuple: its pointer and its int or float

UNRECORDED = "the reply could not be recorded"
_HUNG_UP = "the agent disconnected before a reply"
_NOT_BACK = "the proxy restarted and the agent did not come back for its turn"

Ending = tuple[OpenTurn, Turn]  # an open turn's open_turn, and the turn as it ended


class Endings:
    def __init__(
        self, open_turns: OpenTurns, store: Store, clock: Callable[[], float], observer: Observer | None = None
    ) -> None:
        self._open_turns = open_turns
        self._store = store
        self._now = clock
        self.observer: Observer = observer or Unobserved()
        self._unwritten: dict[str, Turn] = {}  # settled turns whose write is on its way: their latest state
        self._recent: OrderedDict[str, Turn] = OrderedDict()
        self._recent_bytes = 0
        self._background: set[asyncio.Future[Any]] = set()  # writes nobody awaits (`drain` waits for them)
        self._answering: set[asyncio.Future[Any]] = set()  # models answering turns (`wind_down` waits for them too)

    def settle(
        self, endings: Iterable[Ending], told: TrajproxyError | None = None, *, recorded: bool = False
    ) -> tuple[list[Turn | None], asyncio.Future[None] | None]:
        """End open turns, each exactly once, whatever ended them: the one way out of the open turns.

        Each turn leaves the open turns (one that something else settled first is skipped: None in the list
        returned), its ended state stays at hand, and all are recorded in one write (none if `recorded`: the
        database replicas share holds them already). Once that write is done, committed or not, each agent hears:
        its turn if answered and recorded; for an answer the store refused, why (the turn is then recorded failed);
        else `told`, why the turn ended. The observers hear each turn as it ended for good. Returns the turns settled
        and the write."""
        settled: list[Ending] = []
        turns: list[Turn | None] = []
        for open_turn, turn in endings:
            if self._open_turns.settle(turn.id) is None:
                turns.append(None)
                continue
            open_turn.turn = turn
            settled.append((open_turn, turn))
            turns.append(turn)
        if recorded or not settled:
            self._told(settled, told, None)
            return turns, None
        written = self._record([turn for _, turn in settled])
        written.add_done_callback(partial(self._told, settled, told))
        return turns, written

    def end(
        self, open_turns: Iterable[OpenTurn], status: TurnStatus, reason: str | None, told: TrajproxyError | None = None
    ) -> Awaitable[None]:
        """End open turns for one reason (see `settle`). Returns their write: awaiting it raises if it failed."""
        now = self._now()
        _, written = self.settle(
            (
                (open_turn, replace(open_turn.turn, status=status, reason=reason, ended_at=now, lease_id=None))
                for open_turn in open_turns
            ),
            told,
        )
        return written if written is not None else _done()

    def remember(self, turn: Turn) -> None:
        """Keep a recorded turn's latest state at hand, within the bounds, the newest first."""
        if (earlier := self._recent.pop(turn.id, None)) is not None:
            self._recent_bytes -= held_bytes(earlier)
        self._recent[turn.id] = turn
        self._recent_bytes += held_bytes(turn)
        while self._recent and (len(self._recent) > _RECENT_TURNS or self._recent_bytes > _RECENT_BYTES):
            _, oldest = self._recent.popitem(last=False)
            self._recent_bytes -= held_bytes(oldest)

    async def turn(self, turn_id: str) -> Turn:
        """A turn's latest state: open (`OpenTurns`), ended lately, or as the store has it."""
        open_turn = self._open_turns.get(turn_id)
        turn = (
            open_turn.turn
            if open_turn
            else self._unwritten.get(turn_id) or self._recent.get(turn_id) or await self._store.turn(turn_id)
        )
        if turn is None:
            raise NotFound(f"no turn {turn_id!r}")
        return turn

    def submit(self, write: Awaitable[None]) -> asyncio.Future[None]:
        """Let a write (or a task) proceed in the background; a failure is logged, and `drain` waits for it."""
        future = asyncio.ensure_future(write)
        self._background.add(future)
        future.add_done_callback(partial(self._done, self._background, "a background write"))
        return future

    def answering(self, answer: Awaitable[None]) -> asyncio.Future[None]:
        """Let a model answer a turn in the background (a failure is logged). Not a write: `drain` does not wait for
        it (a model may sample for minutes, and a read of the records must not wait on it), `wind_down` does; its
        reply's write, once made, is the turn's own."""
        future = asyncio.ensure_future(answer)
        self._answering.add(future)
        future.add_done_callback(partial(self._done, self._answering, "a model's answer"))
        return future

    async def drain(self) -> None:
        """Wait for the background writes submitted so far (state changes nobody awaited) to be committed."""
        if pending := list(self._background):
            await asyncio.wait(pending)

    async def wind_down(self) -> None:
        """Wait for the models answering turns, then for every write (at shutdown)."""
        if answering := list(self._answering):
            await asyncio.wait(answering)
        await self.drain()

    def _record(self, turns: list[Turn]) -> asyncio.Future[None]:
        """Write settled turns, each kept at hand until the write is done (`drain` waits for it)."""
        written = asyncio.ensure_future(self._store.save_turns(turns))
        for turn in turns:
            self._unwritten[turn.id] = turn
        self._background.add(written)
        written.add_done_callback(partial(self._recorded, turns))
        return written

    def _recorded(self, turns: list[Turn], written: asyncio.Future[None]) -> None:
        self._background.discard(written)
        for turn in turns:
            if self._unwritten.get(turn.id) is turn:  # else a later state of it is on its way
                del self._unwritten[turn.id]
                self.remember(turn)

    def _told(self, settled: list[Ending], told: TrajproxyError | None, written: asyncio.Future[None] | None) -> None:
        """Tell each settled turn's agent, and the observers, how it ended, once its write is done."""
        error = None if written is None else failure(written)
        refused: list[Turn] = []
        for open_turn, turn in settled:
            if written is None:
                self.remember(turn)
            answer = open_turn.answer
            if error is not None and turn.status is TurnStatus.ANSWERED:  # its agent must not get an unrecorded reply
                open_turn.turn = turn = replace(turn, status=TurnStatus.FAILED, reason=UNRECORDED)
                refused.append(turn)
                if not answer.done():
                    if isinstance(error, asyncio.CancelledError):
                        answer.cancel()
                    else:
                        open_turn.fail(error)
            elif not answer.done():
                if turn.status is TurnStatus.ANSWERED:
                    answer.set_result(turn)
                else:
                    open_turn.fail(told or TurnClosed(f"turn {turn.id} is {turn.status} ({turn.reason})"))
            self.observer.settled(turn)
        if error is not None:
            log.warning("the end of %d turns could not be recorded: %s", len(settled), error)
        if refused:
            self._record(refused)

    @staticmethod
    def _done(among: set[asyncio.Future[Any]], what: str, future: asyncio.Future[Any]) -> None:
        among.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.error("%s failed", what, exc_info=future.exception())


def held_bytes(turn: Turn) -> int:
    """About what a settled turn holds in memory: its call as received and as parsed (as much again), or, where its
    body extends an earlier call's, what it adds to both (its body is that call's bytes up to where they differ, and
    its messages before are that call's values: `proxy.http.prefix`), and the token ids and logprobs of its reply.
    About: a continued turn's parse is counted at its body's bytes after the shared ones, the end of the body (the
    tools) with them, though its values are the earlier call's; and what a turn made that the turns after it share
    (its body's first copy, chunks joined) is no longer counted once it leaves, while they hold it."""
    extends = turn.extends
    size = 2 * len(turn.wire) if extends is None else extends.own_bytes + len(turn.wire) - extends.shared_bytes
    if (reply := turn.reply) is not None:
        for values in (reply.prompt_token_ids, reply.completion_token_ids, reply.logprobs):
            if isinstance(values, TokenIds):  # a served prompt: its own ids (its parent's are its parent's)
                size += values.own_bytes
            elif values is not None:
                size += _BYTES_PER_ID * len(values)
    return size


def failure(write: asyncio.Future[Any]) -> BaseException | None:
    """Why a settled write failed, or None if it was committed."""
    return asyncio.CancelledError() if write.cancelled() else write.exception()


def _done() -> asyncio.Future[None]:
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done


class Deadlines:
    def __init__(
        self,
        open_turns: OpenTurns,
        endings: Endings,
        *,
        turn_timeout_s: float,
        retry_grace_s: float,
        restart_grace_s: float,
    ) -> None:
        self._open_turns = open_turns
        self._endings = endings
        self._turn_timeout_s = turn_timeout_s
        self._retry_grace_s = retry_grace_s
        self._restart_grace_s = restart_grace_s

    def expire_later(self, open_turn: OpenTurn, episode: Episode) -> asyncio.TimerHandle:
        """Start the turn timeout of an agent exchange waiting on `open_turn.answer`: if no reply has come when it
        passes, the turn is recorded as expired and every exchange waiting on it hears TurnTimeout. The
        exchange cancels the returned timer when it ends."""
        timeout_s = episode.turn_timeout_s or self._turn_timeout_s
        return asyncio.get_running_loop().call_later(timeout_s, self._expire, open_turn, timeout_s)

    def leave(self, open_turn: OpenTurn) -> None:
        """An agent exchange ended. If it was the turn's last and the turn is unanswered, the turn leaves the
        queue at once (no trainer receives it afterwards) and is abandoned unless a retry comes back for it
        within the retry grace."""
        open_turn.exchanges -= 1
        if open_turn.exchanges > 0 or self._open_turns.get(open_turn.turn.id) is not open_turn:
            return
        self._open_turns.withdraw(open_turn)
        open_turn.grace_timer = asyncio.get_running_loop().call_later(
            self._retry_grace_s, self._abandon, open_turn, _HUNG_UP
        )

    def after_restart(self, open_turn: OpenTurn) -> None:
        """A turn taken back after a restart, its agent not connected: abandoned unless a retry comes back for
        it within the restart grace."""
        loop = asyncio.get_running_loop()
        open_turn.grace_timer = loop.call_later(self._restart_grace_s, self._abandon, open_turn, _NOT_BACK)

    def _expire(self, open_turn: OpenTurn, timeout_s: float) -> None:
        # If it was answered (or closed) at the last moment, its answer is on the way and this does nothing.
        why = f"no reply to turn {open_turn.turn.id} within {timeout_s:g} s; the turn is recorded as expired"
        reason = f"no reply within the turn timeout of {timeout_s:g} s"
        self._endings.end([open_turn], TurnStatus.EXPIRED, reason, TurnTimeout(why))

    def _abandon(self, open_turn: OpenTurn, why: str) -> None:
        self._endings.end([open_turn], TurnStatus.ABANDONED, why)


class Attendance:
    """An agent's exchange held on its parked turn (`Broker.attend`), as a plain context manager: it is entered
    once per turn, where a generator's would cost several calls more."""

    __slots__ = ("_away", "_deadlines", "_episode", "_expiry", "_open_turn")
    _expiry: asyncio.TimerHandle  # the turn timeout, from entering

    def __init__(
        self, open_turn: OpenTurn, episode: Episode, deadlines: Deadlines, away: Callable[[OpenTurn], None] | None
    ) -> None:
        self._open_turn, self._episode, self._deadlines = open_turn, episode, deadlines
        self._away = away  # the other replicas told the agent's exchange ended (`Others.away`), where there are any

    def __enter__(self) -> asyncio.Future[Turn]:
        self._expiry = self._deadlines.expire_later(self._open_turn, self._episode)
        return self._open_turn.answer

    def __exit__(self, *_exc: object) -> None:
        self._expiry.cancel()
        self._deadlines.leave(self._open_turn)
        if self._away is not None:
            self._away(self._open_turn)
