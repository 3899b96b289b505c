"""The context: what every part of the broker shares, built once and passed by keyword.

One store, one token counter, one upstream, one clock, and the in-memory state of this process: the open turns
(open turns and the futures their agents await), the endings (each open turn ended once; writes nobody waits on),
the live episodes, and the deadlines on parked calls. Each part takes the context and keeps what it uses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from proxy.core.endings import Deadlines, Endings
from proxy.core.episodes import LiveEpisodes
from proxy.core.observer import Observer
from proxy.core.open_turns import OpenTurn, OpenTurns
from proxy.core.ports import Store, TokenCounter, Upstream

log = logging.getLogger("trajproxy")


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    store: Store
    tokens: TokenCounter
    upstream: Upstream
    clock: Callable[[], float]
    lease_s: float  # a trainer's lease on a turn, unless its pull names another
    open_turns: OpenTurns
    endings: Endings
    episodes: LiveEpisodes
    deadlines: Deadlines

    @classmethod
    def build(
        cls,
        *,
        store: Store,
        tokens: TokenCounter,
        upstream: Upstream,
        lease_s: float,
        turn_timeout_s: float,
        retry_grace_s: float = 5.0,
        restart_grace_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        observer: Observer | None = None,  # told of each change of state (metrics)
    ) -> Context:
        open_turns = OpenTurns(on_lease_expired=_lease_expired)
        endings = Endings(open_turns, store, clock, observer)
        deadlines = Deadlines(
            open_turns,
            endings,
            turn_timeout_s=turn_timeout_s,
            retry_grace_s=retry_grace_s,
            restart_grace_s=restart_grace_s,
        )
        return cls(
            store=store,
            tokens=tokens,
            upstream=upstream,
            clock=clock,
            lease_s=lease_s,
            open_turns=open_turns,
            endings=endings,
            episodes=LiveEpisodes(store),
            deadlines=deadlines,
        )


def _lease_expired(open_turn: OpenTurn) -> None:
    log.info("lease on turn %s expired; it is back in the queue", open_turn.turn.id)
