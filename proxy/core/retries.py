"""SDK retries: a call an agent's SDK sends again (the same body) belongs to the turn its first attempt made.

An SDK retries when its connection died or timed out: the agent hung up, or the proxy stopped. The retry
attaches to that turn while it is open (or still being written), or gets its recorded reply again if it was
answered meanwhile; it never becomes a second turn.
"""

from __future__ import annotations

import asyncio
import logging

from proxy.core.episodes import LiveEpisode
from proxy.core.open_turns import OpenTurn, OpenTurns
from proxy.core.ports import Store

log = logging.getLogger("trajproxy")

RETRY_LOOKBACK = 16  # an episode's latest answers a retry is matched against (more than its calls at once)


async def retried(open_turns: OpenTurns, store: Store, live: LiveEpisode, wire: bytes) -> OpenTurn | None:
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


async def replayed(store: Store, live: LiveEpisode, wire: bytes) -> OpenTurn | None:
    """The answered turn an SDK retry with this exact body belongs to, as an open turn that replays its reply."""
    answered = live.last_answered
    if answered is None or answered.wire != wire:  # not the last answer this process gave: ask the store
        latest = await store.latest_answered(live.episode.id, RETRY_LOOKBACK)
        answered = next((turn for turn in latest if turn.wire == wire), None)
        if answered is None:
            return None
    replay = OpenTurn(answered, asyncio.get_running_loop().create_future())
    replay.answer.set_result(answered)
    return replay
