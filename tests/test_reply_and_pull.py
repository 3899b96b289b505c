"""One exchange a batch: `POST /api/turns/replies?pull=N` answers a batch and leases the next one, on the fast
lane and through the framework alike, with the same delivery rules as the two calls it replaces."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import httpx
import pytest

from proxy.client import TrainerClient
from tests.test_trainer_api import ask_as


def said(call: Future[Any]) -> str:
    return str(call.result(timeout=10).choices[0].message.content)


def test_a_batch_reply_leases_the_next_batch(trainer: TrainerClient, background: Callable[..., Future[Any]]) -> None:
    episodes = [trainer.create_episode() for _ in range(3)]
    first = background(ask_as, episodes[0])
    [turn] = trainer.next_turns(max=8, wait_s=10)
    later = [background(ask_as, episode) for episode in episodes[1:]]

    replies = [{"turn_id": turn.id, "message": {"content": "first"}, "lease_id": turn.lease_id}]
    outcome = trainer.reply_and_pull(replies, max=8, wait_s=10)
    assert [result.status for result in outcome.results] == [200]
    pulled = list(outcome.turns)
    assert pulled, "the reply that pulls leased nothing"  # it long-polls until a later call parks
    assert all(turn.status == "leased" and turn.lease_id for turn in pulled)
    while len(pulled) < 2:  # the two later calls park apart: the second comes with the next pull
        pulled += trainer.next_turns(max=8, wait_s=10)
    assert said(first) == "first"
    assert {turn.episode_id for turn in pulled} == {episode.id for episode in episodes[1:]}
    assert all(turn.status == "leased" and turn.lease_id for turn in pulled)

    done = trainer.reply_and_pull(
        [{"turn_id": t.id, "message": {"content": "later"}, "lease_id": t.lease_id} for t in pulled], wait_s=0
    )
    assert [result.status for result in done.results] == [200, 200] and done.turns == []
    assert [said(call) for call in later] == ["later", "later"]
    again = trainer.reply_and_pull([{"turn_id": pulled[0].id, "message": {"content": "later"}}], wait_s=0)
    assert [result.status for result in again.results] == [200]  # the same reply again: idempotent


def test_pulling_with_a_reply_says_what_is_wrong(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    headers = {"authorization": f"Bearer {server.token}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=10) as http:
        body = {"replies": [{"turn_id": "tu_nope", "message": {"content": "x"}}]}
        answered = http.post("/api/turns/replies?pull=2&wait=0", json=body).json()
        assert [r["status"] for r in answered["results"]] == [404] and answered["turns"] == []
        for query, said in (("pull=-1", "pull"), ("pull=2&wait=9999", "wait"), ("pull=2&whatever=1", "whatever")):
            refused = http.post(f"/api/turns/replies?{query}", json=body)
            assert refused.status_code == 422 and said in refused.text, (query, refused.text)
        unknown = http.post("/api/turns/replies?pull=1&episode=ep_nope", json=body)
        assert unknown.status_code == 404
    assert trainer.episode(episode.id).status == "pending"


@pytest.mark.parametrize("max_turns", [1, 4096])
def test_the_client_sends_the_pull_it_is_asked_for(trainer: TrainerClient, max_turns: int) -> None:
    reply = [{"turn_id": "tu_nope", "message": {"content": "x"}}]
    assert trainer.reply_and_pull(reply, max=max_turns, wait_s=0).turns == []
