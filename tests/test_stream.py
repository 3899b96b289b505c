"""The trainer's WebSocket stream (`/api/turns/stream`): what only it does. Its delivery rules (leases, redelivery,
idempotent replies) are pinned by the tests that take a `lane`, on every path."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import openai
import orjson
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect, unix_connect

from proxy.client import AsyncTrainerClient, TrainerClient, TrajproxyAPIError
from tests.test_delivery import ask, wait_until
from tests.test_readme import DOCS, python_blocks


def raw_stream(server: Any, query: str = "max=4") -> Any:
    """A WebSocket to the stream, with no client of ours in between."""
    url = server.url.replace("http", "ws", 1) + f"/api/turns/stream?{query}"
    return connect(url, additional_headers={"authorization": f"Bearer {server.token}"}, proxy=None)


def said(socket: Any) -> Any:
    return orjson.loads(socket.recv(timeout=10))


def test_the_stream_is_refused_before_its_handshake_as_http_would_refuse(server: Any, trainer: TrainerClient) -> None:
    with TrainerClient(server.url, token="not-the-token") as stranger, pytest.raises(TrajproxyAPIError) as refused:
        stranger.stream()
    assert refused.value.status == 401 and "TRAJPROXY_TRAINER_TOKEN" in refused.value.message
    for options, status, word in (({"episode": "ep_nope"}, 404, "ep_nope"), ({"max": 0}, 422, "max")):
        with pytest.raises(TrajproxyAPIError) as bad:
            trainer.stream(**options)
        assert (bad.value.status, word in bad.value.message) == (status, True), bad.value
    with pytest.raises(Exception, match="422"):
        raw_stream(server, "max=1&whatever=2")


def test_a_malformed_message_is_answered_with_what_is_wrong_and_the_stream_goes_on(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    call = background(ask, episode)
    with raw_stream(server) as socket:
        pushed = said(socket)
        assert pushed["type"] == "turns" and [turn["status"] for turn in pushed["turns"]] == ["leased"]
        turn = pushed["turns"][0]
        malformed = [
            ("not json", None, 400, "not valid JSON"),
            ("[1, 2]", None, 422, "invalid request"),
            ('{"id": 1, "replies": []}', 1, 422, "replies"),
            ('{"id": 2, "replies": [{"turn_id": "t", "message": {"content": 3}}]}', 2, 422, "0.message.content"),
            ('{"id": "3", "replies": [{"message": {"content": "x"}}]}', "3", 422, "turn_id"),
            ('{"id": 4, "replies": [{"turn_id": "tu_x", "message": {}, "error": {"status": 500, "message": "m"}}]}',
             4, 422, "message"),
            ("[" * 200 + "]" * 200, None, 400, "deeper"),
        ]  # fmt: skip
        for message, message_id, status, word in malformed:
            socket.send(message)
            answer = said(socket)
            assert (answer["type"], answer["id"], answer["status"]) == ("error", message_id, status), (message, answer)
            assert word in answer["error"]["message"], (message, answer)
        socket.send(orjson.dumps({"id": "last", "replies": [{"turn_id": turn["id"], "message": {"content": "ok"}}]}))
        acknowledged = said(socket)
        assert (acknowledged["type"], acknowledged["id"]) == ("results", "last")
        assert [result["status"] for result in acknowledged["results"]] == [200]
    assert call.result(timeout=10).choices[0].message.content == "ok"


def test_a_stream_closed_mid_lease_gives_its_turn_to_another_trainer_at_once(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    call = background(ask, episode)
    with trainer.stream(lease_s=3600) as stream:  # a lease that would outlive the test
        [taken] = stream.turns(wait_s=10)
    [again] = trainer.next_turns(wait_s=10)  # the other trainer: over HTTP
    assert (again.id, again.deliveries) == (taken.id, 2)
    with pytest.raises(TrajproxyAPIError) as stale:
        trainer.reply(taken.id, "from the closed stream", lease_id=taken.lease_id)
    assert stale.value.status == 409
    trainer.reply(again.id, "from the other", lease_id=again.lease_id)
    assert call.result(timeout=10).choices[0].message.content == "from the other"


def test_a_stream_holds_at_most_max_turns_unanswered(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episodes = [trainer.create_episode() for _ in range(3)]
    calls = [background(ask, episode) for episode in episodes]
    wait_until(lambda: server.broker.ready_turns == 3)
    with trainer.stream(max=2) as stream:
        first = stream.turns(wait_s=10)
        while len(first) < 2:
            first += stream.turns(wait_s=10)
        assert len(first) == 2 and server.broker.ready_turns == 1  # the third waits for room
        assert stream.reply(first[0].id, "one", lease_id=first[0].lease_id).status == "answered"
        [third] = stream.turns(wait_s=10)
        assert third.id not in {turn.id for turn in first}
        results = stream.reply_many([{"turn_id": t.id, "message": {"content": "more"}} for t in (first[1], third)])
        assert [result.status for result in results] == [200, 200]
    assert sorted(call.result(timeout=10).choices[0].message.content for call in calls) == ["more", "more", "one"]


def test_an_openai_sdk_agent_is_answered_over_the_stream_until_its_episode_ends(
    server: Any, trainer: TrainerClient
) -> None:
    episode = trainer.create_episode()
    heard: list[str] = []

    def run_agent() -> None:
        with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as agent:
            for text in ("one", "two", "three"):
                reply = agent.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
                heard.append(str(reply.choices[0].message.content))
        trainer.finish(episode.id)

    thread = threading.Thread(target=run_agent)
    thread.start()
    with trainer.stream(episode=episode.id) as stream:
        answered = [stream.reply(turn.id, turn.request["messages"][-1]["content"].upper()).status for turn in stream]
        assert stream.ended is not None and episode.id in stream.ended
    thread.join(timeout=10)
    assert heard == ["ONE", "TWO", "THREE"] and answered == ["answered"] * 3
    turns = trainer.trajectory(episode.id).turns
    assert [(turn.status, turn.deliveries) for turn in turns] == [("answered", 1)] * 3


def test_the_async_client_streams_too(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()

    async def both() -> str:
        async with openai.AsyncOpenAI(
            base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0
        ) as agent:
            call = asyncio.ensure_future(
                agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            )
            async with AsyncTrainerClient(server.url, token=server.token) as client, client.stream(max=8) as stream:
                async for turn in stream:
                    await stream.reply(turn.id, "hello", lease_id=turn.lease_id)
                    break
            return str((await call).choices[0].message.content)

    assert asyncio.run(both()) == "hello"


def test_the_docs_stream_example_runs_as_written(server: Any) -> None:
    [example] = [block for block in python_blocks(DOCS / "trainer-api.md") if "trainer.stream(" in block]
    code = example.replace('TrainerClient("http://127.0.0.1:8000")', f"TrainerClient({server.url!r}, {server.token!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["agent got: you said 'hello?'", "agent got: you said 'still there?'"]


def test_the_stream_is_not_served_on_the_sandbox_socket_even_with_no_token(
    make_server: Callable[..., Any], socket_dir: str
) -> None:
    sock = f"{socket_dir}/proxy.sock"
    make_server(socket_path=sock, no_trainer_token=True)
    for path, status in (("/api/turns/stream", 403), ("/v1/responses", 426)):
        with pytest.raises(InvalidStatus) as refused:
            unix_connect(sock, f"ws://sandbox{path}")
        assert refused.value.response.status_code == status, path
    body = orjson.loads(refused.value.response.body or b"{}")
    assert "plain HTTP" in body["error"]["message"]  # an agent probing WebSockets is told to use HTTP
