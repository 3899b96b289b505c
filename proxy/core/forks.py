"""The broker's part in forks: each fork's replay, loaded from the store when its agent first calls, and what
becomes of each call while it replays (see `proxy.core.fork_plan` for the rules)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

from proxy.core.answers import Answers
from proxy.core.context import Context
from proxy.core.episodes import LiveEpisode
from proxy.core.errors import Conflict
from proxy.core.fork_plan import REPLAYED, ForkPlan, OnDivergence, Replay, replayable
from proxy.core.open_turns import OpenTurn
from proxy.core.values import Answerer, Episode, TurnStatus

log = logging.getLogger("trajproxy")

REPLAYS_KEPT = 4096  # forks replaying at once whose parent's calls are kept in memory


class Forks:
    def __init__(self, *, context: Context, answers: Answers) -> None:
        self._open_turns = context.open_turns
        self._endings = context.endings
        self._store = context.store
        self._answers = answers
        self._now = context.clock
        # fork episode id -> its replay, while it replays; bounded, for forks that end mid-replay leave theirs
        # behind (one dropped early is read again from the store at its fork's next call)
        self._replays: OrderedDict[str, Replay] = OrderedDict()

    async def make(
        self,
        parent: Episode,
        at_turn: int,
        n: int,
        create: Callable[..., Awaitable[tuple[Episode, str]]],
        *,
        policy: Answerer | None = None,
        inherit_policy: bool = True,
        ignore: Sequence[str] = (),
        min_similarity: float = 1.0,
        on_divergence: OnDivergence = "policy",
    ) -> list[tuple[Episode, str]]:
        """n new episodes (made by `create`) on the parent's task, metadata, routes and budget (no deadline), each
        replaying the parent's first `at_turn` calls, then answered by `policy`, or the parent's
        (`inherit_policy`), or the trainer. BadRequest if those calls cannot be replayed."""
        replayable(parent.id, await self._store.turns(parent.id), at_turn)
        plan = ForkPlan(parent.id, at_turn, tuple(ignore), min_similarity, on_divergence)
        metadata = {**parent.metadata, "fork": plan.record()}
        policy = parent.policy if inherit_policy else policy
        budget = replace(parent.budget, deadline_at=None)
        options = {"policy": policy, "routes": parent.routes, "budget": budget}
        return [await create(parent.task, metadata, parent.turn_timeout_s, **options) for _ in range(n)]

    async def replay(self, live: LiveEpisode) -> Replay | None:
        """The episode's replay, if it is a fork still replaying; its parent's calls are read once."""
        plan = ForkPlan.of(live.episode.metadata)
        if plan is None or plan.diverged is not None or live.next_seq >= plan.at_turn:
            self._replays.pop(live.episode.id, None)
            return None
        if (known := self._replays.get(live.episode.id)) is not None:
            self._replays.move_to_end(live.episode.id)
            return known
        recorded = replayable(plan.parent, await self._store.turns(plan.parent), plan.at_turn)
        replay = self._replays.setdefault(live.episode.id, Replay(plan, recorded))
        while len(self._replays) > REPLAYS_KEPT:
            self._replays.popitem(last=False)
        return replay

    async def take(self, live: LiveEpisode, replay: Replay, open_turn: OpenTurn) -> bool:
        """Answer a fork's call from its replay; True when the call is settled here (replayed, or failed on a
        divergence the fork said to fail on), False when it goes on to the fork's policy."""
        turn = open_turn.turn
        verdict = replay.verdict(turn.seq, turn.request)
        if verdict.reply is not None:
            self._open_turns.reserve(open_turn, turn.created_at)
            self._endings.submit(self._answers.answer_reserved(open_turn, replace(verdict.reply, answered_by=REPLAYED)))
            return True
        if verdict.why is None:
            return False
        await self._diverged(live, replay, turn.seq, verdict.why)
        if replay.plan.on_divergence == "policy":
            return False
        why = f"the replay stopped: {verdict.why}"
        self._endings.end([open_turn], TurnStatus.FAILED, why, Conflict(why))
        return True

    async def _diverged(self, live: LiveEpisode, replay: Replay, seq: int, why: str) -> None:
        """Record in the fork's metadata where and why its replay stopped; it replays nothing after that."""
        self._replays.pop(live.episode.id, None)
        plan = replace(replay.plan, diverged={"seq": seq, "why": why, "at": self._now()})
        async with live.writing_episode:
            noted = replace(live.episode, metadata={**live.episode.metadata, "fork": plan.record()})
            await self._store.save_episode(noted)
            live.episode = noted
        log.info("episode %s: %s", live.episode.id, why)
