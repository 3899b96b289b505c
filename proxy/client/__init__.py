"""A small typed client for the trainer API, sync (`TrainerClient`) and async (`AsyncTrainerClient`).

with TrainerClient("http://127.0.0.1:8000") as trainer:
    episode = trainer.create_episode(task="fix the failing test")
    for turn in trainer.next_turns(max=8, wait_s=30):
        trainer.reply(turn.id, content="ls -la", lease_id=turn.lease_id)

    with trainer.stream(max=64) as stream:  # a WebSocket: turns pushed as they park
        for turn in stream:
            stream.reply(turn.id, "ls -la", lease_id=turn.lease_id)
"""

from proxy.client.aio import AsyncTrainerClient
from proxy.client.calls import TrajproxyAPIError
from proxy.client.stream import AsyncTurnStream, TurnStream
from proxy.client.sync import TrainerClient

__all__ = ["AsyncTrainerClient", "AsyncTurnStream", "TrainerClient", "TrajproxyAPIError", "TurnStream"]
