"""A retry from a client that does not say it retries (no `x-stainless-retry-count`: the Gemini SDK's, curl's) is
no second turn: it attaches to the turn its first attempt left open once that attempt is gone,
and gets the reply of the episode's latest turn again when that reply was never handed over (its agent hung up
before it came, or the process that recorded it stopped). The same body again after its reply was handed over is
a new call."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from proxy.client import TrainerClient

ON_SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
BODY = {"contents": [{"role": "user", "parts": [{"text": "once"}]}]}


def url_of(server: Any, key: str) -> str:
    return f"{server.url}/e/{key}/v1beta/models/m:generateContent"


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["candidates"][0]["content"]["parts"][0]["text"])


@ON_SQLITE
@pytest.mark.settings(retry_grace_s=60)
def test_the_same_body_again_after_its_agent_hung_up_is_the_same_turn(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    with pytest.raises(httpx.ReadTimeout):  # no trainer yet: the first attempt gives up, as a client timeout does
        httpx.post(url_of(server, episode.key), json=BODY, timeout=1)
    with ThreadPoolExecutor(1) as pool:
        again = pool.submit(httpx.post, url_of(server, episode.key), json=BODY, timeout=60)  # no header
        turns = trainer.next_turns(max=8, wait_s=30)
        assert len(turns) == 1
        trainer.reply(turns[0].id, content="answered once")
        assert text_of(again.result()) == "answered once"
    assert len(trainer.trajectory(episode.id).turns) == 1


@ON_SQLITE
@pytest.mark.parametrize("then", ["goes on", "restarts"])
def test_a_reply_its_agent_never_got_is_replayed_to_the_same_body_then_a_new_call_after_it_was_handed_over(
    make_server: Callable[..., Any], then: str
) -> None:
    server = make_server(retry_grace_s=60)
    trainer = TrainerClient(server.url, token=server.token)
    episode = trainer.create_episode()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, url_of(server, episode.key), json=BODY, timeout=3)
        [turn] = trainer.next_turns(max=8, wait_s=30)  # leased while its agent waits
        with pytest.raises(httpx.ReadTimeout):
            first.result()  # the agent gives up before the answer comes
    trainer.reply(turn.id, content="answered once", lease_id=turn.lease_id)  # recorded; nobody to hand it to
    if then == "restarts":
        trainer.close()
        server.stop()
        server = make_server(retry_grace_s=60)  # the same database: the new process knows of no hand-over
        trainer = TrainerClient(server.url, token=server.token)
    try:
        assert text_of(httpx.post(url_of(server, episode.key), json=BODY, timeout=30)) == "answered once"
        assert [t.id for t in trainer.trajectory(episode.id).turns] == [turn.id]

        with ThreadPoolExecutor(1) as pool:  # handed over now: the same body once more is the agent asking again
            asked_again = pool.submit(httpx.post, url_of(server, episode.key), json=BODY, timeout=60)
            [second] = trainer.next_turns(max=8, wait_s=30)
            trainer.reply(second.id, content="asked again")
            assert text_of(asked_again.result()) == "asked again"
        assert [t.id for t in trainer.trajectory(episode.id).turns] == [turn.id, second.id]
    finally:
        trainer.close()


@ON_SQLITE
@pytest.mark.settings(retry_grace_s=60)
def test_a_client_that_says_it_does_not_retry_asks_again_with_the_same_body(
    server: Any, trainer: TrainerClient
) -> None:
    """`x-stainless-retry-count: 0` is a first attempt, whatever it repeats: an unanswered call's lost reply is
    not replayed to it."""
    episode = trainer.create_episode()
    url = f"{server.url}/v1/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "once"}]}
    headers = {"authorization": f"Bearer {episode.key}", "x-stainless-retry-count": "0"}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, url, json=body, headers=headers, timeout=3)
        [turn] = trainer.next_turns(max=8, wait_s=30)
        with pytest.raises(httpx.ReadTimeout):
            first.result()
        trainer.reply(turn.id, content="lost", lease_id=turn.lease_id)
        again = pool.submit(httpx.post, url, json=body, headers=headers, timeout=60)
        [second] = trainer.next_turns(max=8, wait_s=30)
        trainer.reply(second.id, content="a new answer")
        assert again.result().json()["choices"][0]["message"]["content"] == "a new answer"
    assert len(trainer.trajectory(episode.id).turns) == 2
