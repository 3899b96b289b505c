"""The three ways a trainer takes turns and answers them, behind one face, so that the tests that pin delivery
(leases, redelivery, idempotent replies) run on each: `GET /api/turns/next` with `POST .../reply`, the batch reply
that also pulls (`POST /api/turns/replies?pull=N`), and the WebSocket stream (`/api/turns/stream`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from proxy import schema
from proxy.client import TrainerClient, TurnStream
from proxy.client.stream import one, reply_item


class Lane(Protocol):
    name: str

    def pull(
        self, episode: str | None = None, max: int = 1, wait_s: float = 0.0, lease_s: float | None = None
    ) -> list[schema.Turn]: ...

    def reply(self, turn_id: str, content: str | None = None, **options: Any) -> schema.Turn: ...

    def reply_many(self, replies: Sequence[dict[str, Any]]) -> list[schema.ReplyResult]: ...

    def close(self) -> None: ...


class HttpLane:
    """A pull, then a reply per turn (or a batch): two exchanges."""

    name = "http"

    def __init__(self, trainer: TrainerClient) -> None:
        self._trainer = trainer

    def pull(
        self, episode: str | None = None, max: int = 1, wait_s: float = 0.0, lease_s: float | None = None
    ) -> list[schema.Turn]:
        return self._trainer.next_turns(episode, max, wait_s, lease_s)

    def reply(self, turn_id: str, content: str | None = None, **options: Any) -> schema.Turn:
        return self._trainer.reply(turn_id, content, **options)

    def reply_many(self, replies: Sequence[dict[str, Any]]) -> list[schema.ReplyResult]:
        return self._trainer.reply_many(replies)

    def close(self) -> None:
        pass


class ReplyPullLane:
    """Every pull rides on a batch reply (`POST /api/turns/replies?pull=N`), never on `GET /api/turns/next`: a
    reply pulls as the last pull asked (without waiting), and what it leases is handed out by the next pull; a pull
    with no reply of its own to send carries one to a turn that does not exist (its 404 checked). So every turn this
    lane hands out was leased by a reply, and a server that ignored `pull` fails the tests that take this lane."""

    name = "reply-pull"

    def __init__(self, trainer: TrainerClient) -> None:
        self._trainer = trainer
        self._pulled: list[schema.Turn] = []
        self._asked: dict[str, Any] = {"episode": None, "max": 1, "lease_s": None}

    def pull(
        self, episode: str | None = None, max: int = 1, wait_s: float = 0.0, lease_s: float | None = None
    ) -> list[schema.Turn]:
        asked: dict[str, Any] = {"episode": episode, "max": max, "lease_s": lease_s}
        if self._pulled:  # leased by the last reply, as the pull before it asked: a pull asking the same takes them
            assert asked == self._asked, f"this lane holds turns pulled for {self._asked}, not for {asked}"
            handed, self._pulled = self._pulled[:max], self._pulled[max:]
            return handed
        self._asked = asked
        outcome = self._trainer.reply_and_pull([NO_TURN], wait_s=wait_s, **asked)
        assert [result.status for result in outcome.results] == [404], outcome.results
        return list(outcome.turns)

    def reply(self, turn_id: str, content: str | None = None, **options: Any) -> schema.Turn:
        return one(self.reply_many([reply_item(turn_id, content, options)]))

    def reply_many(self, replies: Sequence[dict[str, Any]]) -> list[schema.ReplyResult]:
        answered = self._trainer.reply_and_pull(replies, wait_s=0, **self._asked)
        self._pulled += answered.turns
        return answered.results

    def close(self) -> None:
        pass


NO_TURN = {"turn_id": "tu_none", "message": {"content": "a reply that only carries a pull"}}


class StreamLane:
    """A WebSocket stream for each kind of pull asked for (episode, max, lease), each holding at most `max`
    turns unanswered; a reply goes on the stream its turn came from. Closing gives back what is unanswered."""

    name = "ws"

    def __init__(self, trainer: TrainerClient) -> None:
        self._trainer = trainer
        self._streams: dict[tuple[str | None, int, float | None], TurnStream] = {}
        self._came_on: dict[str, TurnStream] = {}

    def pull(
        self, episode: str | None = None, max: int = 1, wait_s: float = 0.0, lease_s: float | None = None
    ) -> list[schema.Turn]:
        key = (episode, max, lease_s)
        if key not in self._streams:
            self._streams[key] = self._trainer.stream(episode, max, lease_s)
        turns = self._streams[key].turns(wait_s)
        self._came_on.update((turn.id, self._streams[key]) for turn in turns)
        return turns

    def reply(self, turn_id: str, content: str | None = None, **options: Any) -> schema.Turn:
        return one(self.reply_many([reply_item(turn_id, content, options)]))

    def reply_many(self, replies: Sequence[dict[str, Any]]) -> list[schema.ReplyResult]:
        stream = self._came_on.get(replies[0]["turn_id"]) or self._any()
        return stream.reply_many(replies)

    def _any(self) -> TurnStream:
        if not self._streams:
            self._streams[(None, 1, None)] = self._trainer.stream(max=1)
        return next(iter(self._streams.values()))

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()


LANES = {lane.name: lane for lane in (HttpLane, ReplyPullLane, StreamLane)}
