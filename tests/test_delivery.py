"""Delivery semantics: leases, redelivery, idempotent replies, abandonment, timeouts, keep-alives. The tests that
take a `lane` run on each way a trainer takes and answers turns (HTTP, replies that pull, the WebSocket)."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import openai
import pytest

from proxy.client import TrainerClient, TrajproxyAPIError
from tests.conftest import error_body
from tests.lanes import Lane

HELLO = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def agent_for(episode: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0)


def ask(episode: Any, text: str = "hello", **kwargs: Any) -> Any:
    with agent_for(episode) as agent:
        return agent.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], **kwargs)


def wait_until(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def test_lease_expiry_redelivers_and_refuses_the_stale_lease(
    server: Any, trainer: TrainerClient, lane: Lane, background: Any
) -> None:
    episode = trainer.create_episode()
    call = background(ask, episode)
    first = lane.pull(wait_s=5, lease_s=0.3)[0]
    assert (first.status, first.deliveries) == ("leased", 1)
    assert lane.pull(wait_s=0) == []  # leased: nobody else gets it meanwhile

    again = lane.pull(wait_s=5)[0]  # the crashed trainer's lease runs out
    assert again.id == first.id
    assert again.deliveries == 2
    assert again.lease_id != first.lease_id

    with pytest.raises(TrajproxyAPIError) as stale:
        lane.reply(first.id, "late", lease_id=first.lease_id)
    assert stale.value.status == 409
    assert "expired" in stale.value.message

    lane.reply(again.id, "on time", lease_id=again.lease_id)
    assert call.result(timeout=5).choices[0].message.content == "on time"
    recorded = trainer.trajectory(episode.id).turns
    assert len(recorded) == 1
    assert (recorded[0].status, recorded[0].deliveries) == ("answered", 2)
    reply = recorded[0].reply
    assert reply is not None and reply.message is not None and reply.message["content"] == "on time"


def test_reply_is_idempotent_and_a_different_reply_conflicts(
    server: Any, trainer: TrainerClient, lane: Lane, background: Any
) -> None:
    episode = trainer.create_episode()
    call = background(ask, episode)
    turn = lane.pull(wait_s=5)[0]
    first = lane.reply(turn.id, "one answer", lease_id=turn.lease_id)
    again = lane.reply(turn.id, "one answer", lease_id=turn.lease_id)
    assert again.id == first.id and again.reply == first.reply

    with pytest.raises(TrajproxyAPIError) as conflict:
        lane.reply(turn.id, "another answer")
    assert conflict.value.status == 409
    assert call.result(timeout=5).choices[0].message.content == "one answer"

    recorded = trainer.trajectory(episode.id).turns
    assert len(recorded) == 1
    reply = recorded[0].reply
    assert reply is not None and reply.message is not None and reply.message["content"] == "one answer"


def test_an_abandoned_turn_is_never_handed_out(server: Any, trainer: TrainerClient, lane: Lane) -> None:
    episode = trainer.create_episode()
    with pytest.raises(httpx.ReadTimeout):  # the agent gives up and hangs up while its turn is parked
        httpx.post(
            f"{server.url}/v1/chat/completions",
            json=HELLO,
            headers={"authorization": f"Bearer {episode.key}"},
            timeout=0.5,
        )
    wait_until(lambda: trainer.trajectory(episode.id).turns[0].status == "abandoned")
    assert lane.pull(wait_s=0.5) == []
    turn_id = trainer.trajectory(episode.id).turns[0].id
    with pytest.raises(TrajproxyAPIError) as gone:
        lane.reply(turn_id, "too late")
    assert gone.value.status == 409
    assert "abandoned" in gone.value.message


def test_an_agent_leaving_during_the_lease_abandons_the_turn(server: Any, trainer: TrainerClient, lane: Lane) -> None:
    episode = trainer.create_episode()
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={**HELLO, "stream": True},
        headers={"authorization": f"Bearer {episode.key}"},
    ) as response:
        assert response.status_code == 200  # keep-alives are flowing; the agent hangs up mid-stream
        turn = lane.pull(wait_s=5, lease_s=60)[0]
    wait_until(lambda: trainer.turn(turn.id).status == "abandoned")
    with pytest.raises(TrajproxyAPIError) as gone:
        lane.reply(turn.id, "too late", lease_id=turn.lease_id)
    assert gone.value.status == 409


@pytest.mark.settings(turn_timeout_s=0.5)
def test_turn_timeout_gives_the_agent_a_504_and_records_expiry(server: Any, trainer: TrainerClient, lane: Lane) -> None:
    episode = trainer.create_episode()
    with pytest.raises(openai.APIStatusError) as timeout:
        ask(episode)
    assert timeout.value.status_code == 504
    assert error_body(timeout.value.body)["type"] == "timeout_error"
    assert "expired" in timeout.value.message

    recorded = trainer.trajectory(episode.id).turns
    assert [(turn.status, turn.reply) for turn in recorded] == [("expired", None)]
    with pytest.raises(TrajproxyAPIError) as late:
        lane.reply(recorded[0].id, "late")
    assert late.value.status == 409


def test_an_episode_can_set_its_own_turn_timeout(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode(turn_timeout_s=0.3)
    with pytest.raises(openai.APIStatusError) as timeout:
        ask(episode)
    assert timeout.value.status_code == 504
    assert "within 0.3 s" in timeout.value.message  # the episode's timeout, not the server's (30 s)
    [turn] = trainer.trajectory(episode.id).turns
    assert (turn.status, turn.reason) == ("expired", "no reply within the turn timeout of 0.3 s")


@pytest.mark.settings(keepalive_s=0.1)
def test_a_stream_already_under_way_reports_the_timeout_as_an_error_event(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode(turn_timeout_s=0.5)
    with agent_for(episode) as agent:
        hello: Any = HELLO
        stream = agent.chat.completions.create(**hello, stream=True)  # headers went out with the first keep-alive
        with pytest.raises(openai.APIError) as timeout:
            list(stream)
    assert "expired" in timeout.value.message
    assert trainer.trajectory(episode.id).turns[0].status == "expired"


def test_finishing_an_episode_fails_its_parked_calls_and_refuses_new_ones(
    server: Any, trainer: TrainerClient, background: Any
) -> None:
    episode = trainer.create_episode()
    parked = background(ask, episode)
    turn = trainer.next_turns(wait_s=5)[0]
    finished = trainer.finish(episode.id, "finished", reason="tests passed")
    assert (finished.status, finished.reason) == ("finished", "tests passed")

    with pytest.raises(openai.APIStatusError) as cut_off:
        parked.result(timeout=5)
    assert cut_off.value.status_code == 410
    assert "tests passed" in cut_off.value.message
    with pytest.raises(openai.APIStatusError) as refused:
        ask(episode)
    assert refused.value.status_code == 410

    recorded = trainer.trajectory(episode.id)
    assert recorded.episode.status == "finished"
    assert [(t.id, t.status) for t in recorded.turns] == [(turn.id, "failed")]
    with pytest.raises(TrajproxyAPIError) as closed:
        trainer.reply(turn.id, "late")
    assert closed.value.status == 409


def as_trainer(server: Any) -> dict[str, str]:
    return {"authorization": f"Bearer {server.token}"}


def test_a_long_poll_whose_client_left_takes_no_turn(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    with pytest.raises(httpx.ReadTimeout):  # a trainer long-polls, then dies
        httpx.get(f"{server.url}/api/turns/next", params={"wait": 30}, headers=as_trainer(server), timeout=0.5)
    wait_until(lambda: httpx.get(f"{server.url}/health").json()["waiting_pollers"] == 0)  # the proxy noticed
    call = background(ask, episode)
    turn = trainer.next_turns(wait_s=5)[0]
    assert turn.deliveries == 1  # nobody else ever held it
    trainer.reply(turn.id, "fresh")
    assert call.result(timeout=5).choices[0].message.content == "fresh"


@pytest.mark.settings(keepalive_s=0.1)
def test_keepalives_flow_while_a_stream_is_parked(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    lines: list[str] = []

    def streaming_agent() -> None:
        with httpx.stream(
            "POST",
            f"{server.url}/v1/chat/completions",
            json={**HELLO, "stream": True},
            headers={"authorization": f"Bearer {episode.key}"},
            timeout=10,
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines.extend(line for line in response.iter_lines() if line)

    agent = threading.Thread(target=streaming_agent)
    agent.start()
    turn = trainer.next_turns(wait_s=5)[0]
    time.sleep(0.6)  # parked for several keep-alive intervals
    trainer.reply(turn.id, "streamed")
    agent.join(timeout=5)

    keepalives = [line for line in lines if line.startswith(":")]
    data = [line for line in lines if line.startswith("data:")]
    assert len(keepalives) >= 3
    assert lines.index(keepalives[-1]) < lines.index(data[0])  # all keep-alives came before the reply
    assert data[-1] == "data: [DONE]"
    assert any('"content":"streamed"' in line for line in data)


def test_concurrent_calls_in_one_episode_are_separate_ordered_turns(
    server: Any, trainer: TrainerClient, background: Any
) -> None:
    episode = trainer.create_episode()
    calls = [background(ask, episode, f"call {i}") for i in range(4)]
    turns: list[Any] = []
    while len(turns) < 4:
        turns += trainer.next_turns(episode=episode.id, max=4, wait_s=5)
    assert sorted(turn.seq for turn in turns) == [0, 1, 2, 3]
    for turn in turns:
        trainer.reply(turn.id, f"re: {turn.request['messages'][0]['content']}")
    assert sorted(call.result(timeout=5).choices[0].message.content for call in calls) == [
        f"re: call {i}" for i in range(4)
    ]


def test_batch_pull_across_episodes_and_for_one(
    server: Any, trainer: TrainerClient, lane: Lane, background: Any
) -> None:
    one, two = trainer.create_episode(), trainer.create_episode()
    calls = [background(ask, episode) for episode in (one, two, one, two, one)]
    wait_until(lambda: server.broker.ready_turns == 5)

    mine = lane.pull(episode=two.id, max=10, wait_s=5)
    assert sorted(turn.episode_id for turn in mine) == [two.id, two.id]
    rest = lane.pull(max=2, wait_s=5)
    assert len(rest) == 2 and {turn.episode_id for turn in rest} == {one.id}
    rest += lane.pull(max=10, wait_s=5)
    assert len(rest) == 3
    assert lane.pull(max=10, wait_s=0) == []
    for turn in mine + rest:
        lane.reply(turn.id, "ok")
    assert [call.result(timeout=5).choices[0].message.content for call in calls] == ["ok"] * 5


def test_pulling_for_an_unknown_episode_is_a_404(server: Any, lane: Lane) -> None:
    with pytest.raises(TrajproxyAPIError) as missing:
        lane.pull(episode="ep_nope", wait_s=1)
    assert missing.value.status == 404


def test_the_sdks_default_retries_do_not_multiply_timed_out_or_refused_calls(
    server: Any, trainer: TrainerClient
) -> None:
    episode = trainer.create_episode(turn_timeout_s=0.3)
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key) as client:  # max_retries=2
        with pytest.raises(openai.APIStatusError) as timeout:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert timeout.value.response.headers["x-should-retry"] == "false"
        assert len(trainer.trajectory(episode.id).turns) == 1  # one call, one turn: no retry became a second

        trainer.finish(episode.id)
        with pytest.raises(openai.APIStatusError) as closed:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
    assert closed.value.status_code == 410
    assert len(trainer.trajectory(episode.id).turns) == 1


def test_a_reply_with_non_finite_logprobs_is_refused_and_the_turn_stays_open(
    server: Any, trainer: TrainerClient, background: Any
) -> None:
    episode = trainer.create_episode()
    call = background(ask, episode)
    turn = trainer.next_turns(wait_s=5)[0]
    refused = httpx.post(
        f"{server.url}/api/turns/{turn.id}/reply",
        content=b'{"message": {"content": "x"}, "logprobs": [-0.5, -Infinity]}',
        headers={"content-type": "application/json", **as_trainer(server)},
    )
    assert refused.status_code in (400, 422)
    assert trainer.turn(turn.id).status == "leased"
    trainer.reply(turn.id, "fine", logprobs=[-0.5, -1e30])
    assert call.result(timeout=5).choices[0].message.content == "fine"


def raw_call(server: Any, episode: Any, body: dict[str, Any], retry: int, timeout_s: float) -> httpx.Response:
    """A call as an SDK sends it, attempt number included."""
    headers = {"authorization": f"Bearer {episode.key}", "x-stainless-retry-count": str(retry)}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=timeout_s)


def hang_up(server: Any, episode: Any, body: dict[str, Any], after_s: float) -> None:
    """A first attempt that gives up while its turn is parked."""
    with pytest.raises(httpx.ReadTimeout):
        raw_call(server, episode, body, retry=0, timeout_s=after_s)


@pytest.mark.settings(retry_grace_s=10)
def test_the_sdks_own_retry_attaches_to_the_turn_already_parked(
    server: Any, trainer: TrainerClient, background: Any
) -> None:
    episode = trainer.create_episode()
    # Retries to spare: on a loaded machine the second attempt may time out too before the reply comes; each
    # attaches to the same turn all the same.
    with openai.OpenAI(
        base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, timeout=2.0, max_retries=4
    ) as client:
        call = background(client.chat.completions.create, model="m", messages=[{"role": "user", "content": "slow"}])
        turn = trainer.next_turns(wait_s=5)[0]
        time.sleep(3.0)  # the first attempt times out at 2 s; the SDK retries the same body
        trainer.reply(turn.id, "worth the wait", lease_id=turn.lease_id)
        assert call.result(timeout=10).choices[0].message.content == "worth the wait"
    recorded = trainer.trajectory(episode.id).turns
    assert [(t.id, t.status) for t in recorded] == [(turn.id, "answered")]  # one call, one turn


@pytest.mark.settings(retry_grace_s=10)
def test_a_hung_up_turn_leaves_the_queue_until_its_retry_brings_it_back(
    server: Any, trainer: TrainerClient, background: Any
) -> None:
    episode = trainer.create_episode()
    hang_up(server, episode, HELLO, after_s=0.5)
    wait_until(lambda: httpx.get(f"{server.url}/health").json()["ready_turns"] == 0)  # the proxy saw it go
    assert trainer.next_turns(wait_s=0.5) == []  # its agent is gone: no trainer gets it
    retried = background(raw_call, server, episode, HELLO, 1, 10)
    turn = trainer.next_turns(wait_s=5)[0]  # the retry brought it back
    trainer.reply(turn.id, "found you")
    assert retried.result(timeout=10).json()["choices"][0]["message"]["content"] == "found you"
    assert len(trainer.trajectory(episode.id).turns) == 1


@pytest.mark.settings(retry_grace_s=10)
def test_a_retry_of_an_answered_call_replays_the_recorded_reply(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    first = threading.Thread(target=hang_up, args=(server, episode, HELLO, 1.0))
    first.start()
    turn = trainer.next_turns(wait_s=5)[0]
    first.join()  # the agent hung up while the trainer held the turn
    trainer.reply(turn.id, "recorded", lease_id=turn.lease_id)
    replayed = raw_call(server, episode, HELLO, retry=1, timeout_s=5)
    assert replayed.json()["choices"][0]["message"]["content"] == "recorded"
    assert [t.status for t in trainer.trajectory(episode.id).turns] == ["answered"]

    changed = {**HELLO, "messages": [{"role": "user", "content": "something else"}]}
    other = threading.Thread(target=raw_call, args=(server, episode, changed, 1, 5))
    other.start()
    fresh = trainer.next_turns(wait_s=5)[0]  # a retry header on a new body is a new call
    assert fresh.id != turn.id
    trainer.reply(fresh.id, "new")
    other.join()
    assert len(trainer.trajectory(episode.id).turns) == 2


def test_a_batch_of_replies_succeeds_or_fails_item_by_item(
    server: Any, trainer: TrainerClient, lane: Lane, background: Any
) -> None:
    episodes = [trainer.create_episode() for _ in range(3)]
    calls = [background(ask, episode, f"q{i}") for i, episode in enumerate(episodes)]
    turns: list[Any] = []
    while len(turns) < 3:
        turns += lane.pull(max=8, wait_s=5)
    batch = [{"turn_id": t.id, "message": {"content": f"a:{t.request['messages'][0]['content']}"}} for t in turns]
    results = lane.reply_many([*batch, {"turn_id": "tu_missing", "message": {"content": "x"}}])
    assert [r.status for r in results] == [200, 200, 200, 404]
    assert results[3].error is not None and "tu_missing" in results[3].error.message
    assert sorted(c.result(timeout=5).choices[0].message.content for c in calls) == ["a:q0", "a:q1", "a:q2"]

    again = lane.reply_many([*batch[:1], {**batch[1], "message": {"content": "changed"}}])
    assert [r.status for r in again] == [200, 409]  # idempotent, and no second answer
    kept = trainer.turn(turns[1].id).reply
    assert kept is not None and kept.message is not None
    assert kept.message["content"] == batch[1]["message"]["content"]


def test_pause_holds_new_calls_while_turns_in_flight_drain(
    server: Any, trainer: TrainerClient, background: Any
) -> None:
    episode = trainer.create_episode()
    in_flight = background(ask, episode, "before")
    wait_until(lambda: httpx.get(f"{server.url}/health").json()["ready_turns"] == 1)
    assert trainer.pause("hold").paused == "hold"
    held = background(ask, episode, "during")
    wait_until(lambda: httpx.get(f"{server.url}/health").json()["open_turns"] == 2)
    [draining] = trainer.next_turns(max=8, wait_s=0.5)  # the turn parked before the pause still drains
    assert draining.request["messages"][0]["content"] == "before"
    trainer.reply(draining.id, "old weights", policy_version="v1")
    assert trainer.next_turns(max=8, wait_s=0.5) == []  # the held call is not handed out
    assert httpx.get(f"{server.url}/health").json()["paused"] == "hold"

    assert trainer.resume().released == 1
    [released] = trainer.next_turns(wait_s=5)
    trainer.reply(released.id, "new weights", policy_version="v2")
    assert in_flight.result(timeout=5).choices[0].message.content == "old weights"
    assert held.result(timeout=5).choices[0].message.content == "new weights"
    versions = [turn.reply.policy_version if turn.reply else None for turn in trainer.trajectory(episode.id).turns]
    assert versions == ["v1", "v2"]


def test_pause_can_reject_new_calls_with_retry_after(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    trainer.pause("reject", retry_after_s=7)
    with pytest.raises(openai.RateLimitError) as refused:
        ask(episode)
    assert refused.value.response.headers["retry-after"] == "7"
    assert "x-should-retry" not in refused.value.response.headers  # the SDK may retry after the pause
    assert trainer.trajectory(episode.id).turns == []
    trainer.resume()
    assert httpx.get(f"{server.url}/health").json()["paused"] is None
