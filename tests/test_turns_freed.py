"""An answered call's objects are freed by reference counting as the call ends: none waits for the collector, which
`trajproxy serve` runs minutes apart (`proxy.cli.serve.GC_THRESHOLDS`). A reference cycle around a call held its
turn, its body and its token ids until then: a long episode's server grew by a turn's size on every turn (1.7 MB a
turn near 120k tokens, RESULTS.md section 42), each new turn's memory fresh from the kernel."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

from proxy.client import TrainerClient
from proxy.core.values import Turn
from tests.test_trajectory_memory import episode_of


def _holds_a_turn(thing: Any, episode_id: str) -> bool:
    if isinstance(thing, Turn):
        return thing.episode_id == episode_id
    if isinstance(thing, asyncio.Future) and thing.done() and not thing.cancelled() and thing.exception() is None:
        return isinstance(result := thing.result(), Turn) and result.episode_id == episode_id
    return False


def test_an_answered_call_leaves_nothing_of_its_turn_to_the_collector(trainer: TrainerClient) -> None:
    gc.collect()
    gc.disable()  # the server's thread too: whatever a cycle holds now stays until the collection below
    try:
        episode_id, _ = episode_of(trainer, 6, seed=3)  # six calls of 256 KiB, each answered
        time.sleep(0.2)  # the calls' last callbacks, on the server's loop
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collection finds unreachable is kept in gc.garbage, to be looked at
        gc.collect()
        left = [type(thing).__name__ for thing in gc.garbage if _holds_a_turn(thing, episode_id)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == [], f"the collector found the episode's turns held by a reference cycle: {left}"
