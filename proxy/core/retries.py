"""SDK retries: a call an agent's SDK sends again (the same body) belongs to the turn its first attempt made.

An SDK retries when its connection died or timed out: the agent hung up, or the proxy stopped. The retry
attaches to that turn while it is open (or still being written), or gets its recorded reply again if it was
answered meanwhile; it never becomes a second turn.

A call that does not say whether it is a retry (no `x-stainless-retry-count`: the Gemini SDK, curl)
is one by its body and its place: the same body as an open turn no agent waits on, or as the episode's latest
turn, answered, whose reply was never handed over to an agent here (`lost_reply`). The same body as a reply its
agent was handed is a new call: an agent may ask the same thing again.
"""

from __future__ import annotations

import asyncio
import logging

from proxy.core.chunks import Body
from proxy.core.episodes import LiveEpisode
from proxy.core.open_turns import OpenTurn, OpenTurns
from proxy.core.ports import Store
from proxy.core.values import Turn, TurnStatus

log = logging.getLogger("trajproxy")

RETRY_LOOKBACK = 16  # an episode's latest answers a retry is matched against (more than its calls at once)


async def retried(open_turns: OpenTurns, store: Store, live: LiveEpisode, wire: Body) -> OpenTurn | None:
    """The turn an SDK retry with this exact body belongs to: still open (or still being written), or
    answered, its reply lost on the way (the agent hung up, or the proxy stopped before sending it); the
    retry then gets that reply again."""
    for write in [write for write, body in live.recording.items() if body == wire]:
        log.debug("episode %s: a retry waits for its first attempt's turn, still being recorded", live.episode.id)
        await asyncio.shield(write)
    episode_id = live.episode.id
    for open_turn in open_turns.of_episode(episode_id):
        if open_turn.turn.wire == wire:
            open_turn.exchanges += 1
            if open_turn.grace_timer is not None:
                open_turn.grace_timer.cancel()
                open_turn.grace_timer = None
            open_turns.restore(open_turn)
            return open_turn
    return await replayed(store, live, wire)


async def replayed(store: Store, live: LiveEpisode, wire: Body) -> OpenTurn | None:
    """The answered turn an SDK retry with this exact body belongs to, as an open turn that replays its reply."""
    answered = live.last_answered
    if answered is None or answered.wire != wire:  # not the last answer this process gave: ask the store
        latest = await store.latest_answered(live.episode.id, RETRY_LOOKBACK)
        answered = next((turn for turn in latest if turn.wire == wire), None)
        if answered is None:
            return None
    return _replay(answered)


def orphaned(open_turns: OpenTurns, episode_id: str, wire: Body) -> bool:
    """Whether a call has the body of an open turn no agent waits on (its agent hung up, or an earlier process
    recorded it): its first attempt is gone, so it is that turn's retry whether or not its SDK says so."""
    return any(t.exchanges == 0 and t.turn.wire == wire for t in open_turns.of_episode(episode_id))


async def lost_reply(store: Store, live: LiveEpisode, wire: Body) -> OpenTurn | None:
    """For a call that does not say whether it is a retry: the episode's latest turn, as an open turn that replays
    its reply, if it has this exact body and was answered with no agent here handed the reply (the agent hung up
    before it came, or an earlier process stopped before sending it). One process per database: the episode's
    latest turn is the last one this process recorded, or, before it has recorded any, the store's."""
    if live.next_seq > live.loaded_seq:
        latest = live.last_answered
        if latest is None or latest.seq != live.next_seq - 1:
            return None
    elif live.next_seq == 0:
        return None
    else:  # read once: the first call of an episode an earlier process served
        found = await store.turns_after(live.episode.id, live.next_seq - 2, 1)
        latest = found[0] if found else None
    return unsent(latest, live, wire)


def unsent(latest: Turn | None, live: LiveEpisode, wire: Body) -> OpenTurn | None:
    """`latest` (the episode's latest turn) as a replay of its reply, if it has this body and is answered, its reply
    handed over to no agent here."""
    if latest is None or latest.status is not TurnStatus.ANSWERED or latest.wire != wire:
        return None
    if latest.id in live.handed_over:
        return None
    log.debug("episode %s: a call with the body of its latest turn, its reply never handed over", live.episode.id)
    return _replay(latest)


def _replay(answered: Turn) -> OpenTurn:
    replay = OpenTurn(answered, asyncio.get_running_loop().create_future())
    replay.answer.set_result(answered)
    return replay
