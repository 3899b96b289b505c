"""The trainer API end to end: episodes, rewards, trajectories, bad input, the trainer token and isolation.

Every test runs a live trajproxy (SQLite and Postgres), drives it with the real clients (`TrainerClient`,
the `openai` SDK as the agent, raw httpx for what no well-behaved client would send), and checks both the
answer and that nothing already recorded changed when a request was refused.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import httpx
import openai
import pytest
import tiktoken
from fastapi import FastAPI

from proxy.client import TrainerClient, TrajproxyAPIError
from proxy.http.docs import framework_app
from proxy.settings import Settings
from tests.conftest import error_body, new_token, start_server
from tests.lanes import Lane

MODEL = "gpt-4o"
HELLO = [{"role": "user", "content": "hello"}]
TOKEN = "s3cret"


# Helpers


def agent_for(episode: Any, **kwargs: Any) -> openai.OpenAI:
    """The agent, configured only from what POST /api/episodes handed out."""
    kwargs.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.env["OPENAI_API_KEY"], **kwargs)


def ask(agent: openai.OpenAI, messages: list[dict[str, Any]] = HELLO, **kwargs: Any) -> Any:
    return agent.chat.completions.create(model=MODEL, messages=messages, **kwargs)  # type: ignore[arg-type]


def ask_as(episode: Any, messages: list[dict[str, Any]] = HELLO, **kwargs: Any) -> Any:
    """One call by the episode's agent, on a client of its own that is closed after it, answered or not."""
    with agent_for(episode) as agent:
        return ask(agent, messages, **kwargs)


AS_TRAINER = "<the server's trainer token>"


def api(server: Any, method: str, path: str, token: str | None = AS_TRAINER, **kwargs: Any) -> httpx.Response:
    """A raw request to the proxy; `token` goes out as a bearer token (by default the server's trainer token, on
    /api routes; None sends none)."""
    headers = dict(kwargs.pop("headers", {}))
    if token == AS_TRAINER:
        secret = server.settings.trainer_token
        token = secret.get_secret_value() if secret is not None and path.startswith("/api") else None
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    return httpx.request(method, server.url + path, headers=headers, timeout=10, **kwargs)


def error_of(response: httpx.Response, status: int, kind: str | None = None) -> dict[str, Any]:
    """Assert an error response in the OpenAI shape with a real message; returns its `error` object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert isinstance(body, dict)
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict)
    assert isinstance(error["message"], str)
    assert len(error["message"]) > 10, error
    assert isinstance(error["type"], str)
    assert error["type"]
    if kind is not None:
        assert error["type"] == kind, error
    return error


def snapshot(server: Any, episode_id: str, token: str | None = AS_TRAINER) -> dict[str, Any]:
    """The episode's whole recorded trajectory, as raw JSON, for before/after comparisons."""
    response = api(server, "GET", f"/api/episodes/{episode_id}/trajectory", token)
    assert response.status_code == 200, response.text
    trajectory = response.json()
    assert isinstance(trajectory, dict)
    return trajectory


def wait_parked(trainer: TrainerClient, episode_id: str, count: int = 1) -> list[Any]:
    """Wait (polling, not sleeping a fixed time) until the episode has `count` turns recorded."""
    deadline = time.monotonic() + 5
    while True:
        turns = trainer.trajectory(episode_id).turns
        if len(turns) >= count:
            return turns
        assert time.monotonic() < deadline, f"only {len(turns)} turns parked"
        time.sleep(0.02)


def pull_one(trainer: TrainerClient, episode_id: str) -> Any:
    turns = trainer.next_turns(episode=episode_id, wait_s=5)
    assert len(turns) == 1, turns
    return turns[0]


def chunks(data: bytes, size: int = 500) -> Iterator[bytes]:
    """A body sent with chunked transfer encoding (no Content-Length)."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


def o200k() -> Any:
    # Creating the app pointed TIKTOKEN_CACHE_DIR at litellm's bundled BPE files (no network needed).
    return tiktoken.get_encoding("o200k_base")


# 1. Episodes


def test_create_episode_returns_id_key_and_the_agent_env(server: Any, trainer: TrainerClient) -> None:
    response = api(server, "POST", "/api/episodes", json={"task": "fix the bug", "metadata": {"repo": "x/y", "n": 3}})
    assert response.status_code == 201, response.text
    created = response.json()
    assert created["id"].startswith("ep_")
    key = created["key"]
    assert key.startswith("tpk-")
    assert len(key) > 30
    assert created["status"] == "pending"
    assert created["task"] == "fix the bug"
    assert created["metadata"] == {"repo": "x/y", "n": 3}
    assert created["started_at"] is None
    assert created["ended_at"] is None
    env = created["env"]
    assert env["OPENAI_BASE_URL"] == f"{server.url}/v1"
    assert env["OPENAI_API_KEY"] == key
    assert env["ANTHROPIC_BASE_URL"] == server.url
    assert env["ANTHROPIC_API_KEY"] == key
    assert (env["GOOGLE_GEMINI_BASE_URL"], env["GEMINI_API_KEY"]) == (server.url, key)

    other = trainer.create_episode()
    assert other.id != created["id"]
    assert other.key != key
    assert other.env["OPENAI_BASE_URL"].endswith("/v1")


def test_get_episode_and_no_read_ever_returns_the_key(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode(task="t", metadata={"a": 1}, turn_timeout_s=60)
    answer = background(ask_as, episode)
    turn = pull_one(trainer, episode.id)
    trainer.reply(turn.id, "ok")
    assert answer.result(timeout=10).choices[0].message.content == "ok"

    got = trainer.episode(episode.id)
    assert got.id == episode.id
    assert got.task == "t"
    assert got.metadata == {"a": 1}
    assert got.turn_timeout_s == 60
    assert got.status == "running"
    assert got.started_at is not None

    reads = [
        f"/api/episodes/{episode.id}",
        "/api/episodes",
        f"/api/episodes/{episode.id}/trajectory",
        f"/api/turns/{turn.id}",
    ]
    for path in reads:
        response = api(server, "GET", path)
        assert response.status_code == 200, (path, response.text)
        assert episode.key not in response.text, path
        assert episode.key.removeprefix("tpk-") not in response.text, path
        assert '"key"' not in response.text, path
        assert "key_hash" not in response.text, path


def test_list_episodes_filters_by_status_and_pages(trainer: TrainerClient) -> None:
    created = [trainer.create_episode(task=f"task {i}").id for i in range(5)]
    trainer.finish(created[1], "finished")
    trainer.finish(created[3], "finished")
    trainer.finish(created[4], "failed", reason="crashed")

    assert {e.id for e in trainer.episodes(status="finished").episodes} == {created[1], created[3]}
    assert [e.id for e in trainer.episodes(status="failed").episodes] == [created[4]]
    assert {e.id for e in trainer.episodes(status="pending").episodes} == {created[0], created[2]}
    assert trainer.episodes(status="cancelled").episodes == []
    assert all(e.status == "finished" for e in trainer.episodes(status="finished").episodes)

    everything = trainer.episodes()
    assert [e.id for e in everything.episodes] == created[::-1]  # newest first
    assert everything.next_offset is None

    seen: list[str] = []
    offset: int | None = 0
    pages = 0
    while offset is not None:
        page = trainer.episodes(limit=2, offset=offset)
        assert len(page.episodes) <= 2
        seen += [e.id for e in page.episodes]
        offset = page.next_offset
        pages += 1
    assert pages == 3
    assert seen == created[::-1]

    assert trainer.episodes(limit=4).next_offset == 4
    assert trainer.episodes(limit=5).next_offset is None
    last = trainer.episodes(limit=2, offset=4)
    assert [e.id for e in last.episodes] == [created[0]]
    assert last.next_offset is None
    assert trainer.episodes(limit=2, offset=10).episodes == []
    finished_page = trainer.episodes(status="finished", limit=1)
    assert len(finished_page.episodes) == 1
    assert finished_page.next_offset == 1


def test_list_episodes_refuses_a_bad_query(server: Any, trainer: TrainerClient) -> None:
    trainer.create_episode()
    for query in ("status=bogus", "limit=0", "limit=1001", "offset=-1", "limit=ten"):
        error = error_of(api(server, "GET", f"/api/episodes?{query}"), 422, "invalid_request_error")
        assert query.partition("=")[0] in error["message"], error


def test_finish_records_status_and_reason_and_is_idempotent(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    finished = trainer.finish(episode.id, "failed", reason="agent crashed")
    assert finished.status == "failed"
    assert finished.reason == "agent crashed"
    assert finished.ended_at is not None
    assert trainer.episode(episode.id).status == "failed"

    again = trainer.finish(episode.id, "failed", reason="agent crashed")
    assert again.status == "failed"
    assert again.ended_at == finished.ended_at

    before = snapshot(server, episode.id)
    with pytest.raises(TrajproxyAPIError) as refused:
        trainer.finish(episode.id, "finished")
    assert refused.value.status == 409
    assert refused.value.kind == "conflict_error"
    assert "failed" in refused.value.message
    error_of(api(server, "POST", f"/api/episodes/{episode.id}/finish", json={"status": "cancelled"}), 409)
    assert snapshot(server, episode.id) == before

    other = trainer.create_episode()
    error = error_of(api(server, "POST", f"/api/episodes/{other.id}/finish", json={"status": "running"}), 422)
    assert "status" in error["message"]
    assert trainer.episode(other.id).status == "pending"


def test_a_finish_reason_is_bounded_like_other_free_text(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    long = api(server, "POST", f"/api/episodes/{episode.id}/finish", json={"status": "failed", "reason": "x" * 2001})
    error = error_of(long, 422)
    assert "reason" in error["message"] and "\n" not in error["message"] and len(error["message"]) < 300
    assert trainer.episode(episode.id).status == "pending"
    assert trainer.finish(episode.id, "failed", reason="y" * 2000).reason == "y" * 2000


def test_finishing_an_episode_ends_its_parked_call_and_retires_its_key(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    with agent_for(episode) as agent:
        parked = background(ask, agent)
        wait_parked(trainer, episode.id)
        trainer.finish(episode.id, "cancelled", reason="out of time")

        with pytest.raises(openai.APIStatusError) as closed:
            parked.result(timeout=10)
        assert closed.value.status_code == 410
        assert "out of time" in str(closed.value)

        before = snapshot(server, episode.id)
        assert [t["status"] for t in before["turns"]] == ["failed"]
        with pytest.raises(openai.APIStatusError) as again:
            ask(agent)
        assert again.value.status_code == 410
        error_of(
            api(server, "POST", f"/e/{episode.key}/v1/chat/completions", json={"messages": HELLO}),
            410,
            "episode_closed",
        )
        assert snapshot(server, episode.id) == before


def test_unknown_episode_or_turn_is_404(server: Any, trainer: TrainerClient) -> None:
    for method, path, body in [
        ("GET", "/api/episodes/ep_nope", None),
        ("GET", "/api/episodes/ep_nope/trajectory", None),
        ("POST", "/api/episodes/ep_nope/finish", {"status": "finished"}),
        ("POST", "/api/episodes/ep_nope/rewards", {"value": 1.0}),
        ("GET", "/api/turns/next?episode=ep_nope", None),
        ("GET", "/api/turns/tu_nope", None),
        ("POST", "/api/turns/tu_nope/reply", {"message": {"content": "hi"}}),
    ]:
        error = error_of(api(server, method, path, json=body), 404, "not_found_error")
        assert "_nope" in error["message"], (path, error)
    assert trainer.episodes().episodes == []


# 2. Rewards


def test_episode_and_turn_rewards_show_up_in_the_trajectory(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    turn_ids = []
    for text in ("first", "second"):
        answer = background(ask_as, episode)
        turn = pull_one(trainer, episode.id)
        trainer.reply(turn.id, text)
        answer.result(timeout=10)
        turn_ids.append(turn.id)

    passed = trainer.add_reward(
        episode.id, 1.0, "tests_passed", source="grader", info={"passed": 7, "failed": 0, "log": ["ok"]}
    )
    assert passed.id
    assert passed.episode_id == episode.id
    assert passed.turn_id is None
    assert passed.source == "grader"
    style = trainer.add_reward(episode.id, -0.25, "style")
    assert style.source == "trainer"
    shaped = trainer.add_reward(episode.id, 0.5, "progress", turn_id=turn_ids[1], source="critic", info={"v": 0.4})
    assert shaped.turn_id == turn_ids[1]

    trajectory = trainer.trajectory(episode.id)
    top = {r.name: r for r in trajectory.rewards}
    assert set(top) == {"tests_passed", "style"}
    assert top["tests_passed"].value == 1.0
    assert top["tests_passed"].source == "grader"
    assert top["tests_passed"].info == {"passed": 7, "failed": 0, "log": ["ok"]}
    assert top["style"].value == -0.25
    assert trajectory.turns[0].rewards == []
    [on_turn] = trajectory.turns[1].rewards
    assert on_turn.name == "progress"
    assert on_turn.value == 0.5
    assert on_turn.source == "critic"
    assert on_turn.info == {"v": 0.4}
    assert on_turn.turn_id == turn_ids[1]
    assert on_turn.id == shaped.id


def test_non_finite_reward_values_are_refused_and_nothing_is_recorded(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    answer = background(ask_as, episode)
    turn = pull_one(trainer, episode.id)
    trainer.reply(turn.id, "ok")
    answer.result(timeout=10)
    trainer.add_reward(episode.id, 0.5, "kept")
    before = snapshot(server, episode.id)

    for literal in ("NaN", "Infinity", "-Infinity", "1e999", "-1e999"):
        for turn_part in ("", f', "turn_id": "{turn.id}"'):
            body = f'{{"name": "r", "value": {literal}{turn_part}}}'.encode()
            response = api(
                server,
                "POST",
                f"/api/episodes/{episode.id}/rewards",
                content=body,
                headers={"content-type": "application/json"},
            )
            assert response.status_code in (400, 422), (literal, response.text)
            error_of(response, response.status_code)
    assert snapshot(server, episode.id) == before
    assert [r.name for r in trainer.trajectory(episode.id).rewards] == ["kept"]


def test_reward_for_another_episodes_turn_or_an_unknown_episode_is_404(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    mine = trainer.create_episode()
    theirs = trainer.create_episode()
    answer = background(ask_as, theirs)
    their_turn = pull_one(trainer, theirs.id)
    trainer.reply(their_turn.id, "ok")
    answer.result(timeout=10)
    mine_before = snapshot(server, mine.id)
    theirs_before = snapshot(server, theirs.id)

    with pytest.raises(TrajproxyAPIError) as wrong_episode:
        trainer.add_reward(mine.id, 1.0, turn_id=their_turn.id)
    assert wrong_episode.value.status == 404
    assert their_turn.id in wrong_episode.value.message
    with pytest.raises(TrajproxyAPIError) as no_turn:
        trainer.add_reward(mine.id, 1.0, turn_id="tu_missing")
    assert no_turn.value.status == 404
    with pytest.raises(TrajproxyAPIError) as no_episode:
        trainer.add_reward("ep_missing", 1.0)
    assert no_episode.value.status == 404
    assert no_episode.value.kind == "not_found_error"
    assert "ep_missing" in no_episode.value.message

    assert snapshot(server, mine.id) == mine_before
    assert snapshot(server, theirs.id) == theirs_before


# 3. Trajectory


def test_trajectory_has_ordered_turns_with_request_reply_usage_and_timings(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode(task="count files")
    conversations = [
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello there"}],
        [{"role": "user", "content": "second question"}],
        [{"role": "user", "content": "third: list the files"}],
    ]
    pulled = []

    # seq 0: no usage from the trainer, so the proxy counts tokens with tiktoken
    answer = background(ask_as, episode, conversations[0])
    turn = pull_one(trainer, episode.id)
    pulled.append(turn)
    assert turn.status == "leased"
    assert turn.request["messages"] == conversations[0]
    trainer.reply(turn.id, "hi, how can I help?")
    completion = answer.result(timeout=10)
    assert completion.choices[0].message.content == "hi, how can I help?"
    counted = completion.usage
    assert counted.completion_tokens == len(o200k().encode("hi, how can I help?"))
    assert counted.prompt_tokens > 0
    assert counted.total_tokens == counted.prompt_tokens + counted.completion_tokens

    # seq 1: the trainer's own usage is what everyone sees
    answer = background(ask_as, episode, conversations[1])
    turn = pull_one(trainer, episode.id)
    pulled.append(turn)
    trainer.reply(turn.id, "two", usage={"prompt_tokens": 123, "completion_tokens": 45}, finish_reason="length")
    completion = answer.result(timeout=10)
    assert completion.choices[0].finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (123, 45)
    assert completion.usage.total_tokens == 168

    # seq 2: a tool call
    answer = background(ask_as, episode, conversations[2])
    turn = pull_one(trainer, episode.id)
    pulled.append(turn)
    trainer.reply(turn.id, tool_calls=[{"function": {"name": "bash", "arguments": {"cmd": "ls"}}}])
    completion = answer.result(timeout=10)
    [call] = completion.choices[0].message.tool_calls
    assert call.function.name == "bash"
    assert json.loads(call.function.arguments) == {"cmd": "ls"}

    trajectory = trainer.trajectory(episode.id)
    assert trajectory.episode.id == episode.id
    assert trajectory.episode.status == "running"
    assert trajectory.episode.task == "count files"
    assert [t.seq for t in trajectory.turns] == [0, 1, 2]
    assert [t.id for t in trajectory.turns] == [t.id for t in pulled]
    for recorded, messages in zip(trajectory.turns, conversations, strict=True):
        assert recorded.episode_id == episode.id
        assert recorded.status == "answered"
        assert recorded.dialect == "chat"
        assert recorded.model == MODEL
        assert recorded.request["messages"] == messages
        assert recorded.request["model"] == MODEL
        assert recorded.reply is not None
        assert recorded.reply.answered_by == "trainer"
        assert recorded.reply.error is None
        assert recorded.leased_at is not None
        assert recorded.answered_at is not None
        assert recorded.created_at <= recorded.leased_at <= recorded.answered_at
        assert trajectory.episode.started_at is not None
        assert trajectory.episode.started_at <= recorded.created_at
        usage = recorded.reply.usage
        assert usage is not None
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    first, second, third = trajectory.turns
    assert first.created_at <= second.created_at <= third.created_at
    said, cut, called = first.reply, second.reply, third.reply
    assert said is not None and said.message is not None and said.usage is not None
    assert said.message["content"] == "hi, how can I help?"
    assert said.finish_reason == "stop"
    assert (said.usage.prompt_tokens, said.usage.completion_tokens) == (
        counted.prompt_tokens,
        counted.completion_tokens,
    )
    assert cut is not None and cut.usage is not None
    assert (cut.usage.prompt_tokens, cut.usage.completion_tokens) == (123, 45)
    assert cut.finish_reason == "length"
    assert called is not None and called.message is not None and called.usage is not None
    assert called.finish_reason == "tool_calls"
    assert called.message["tool_calls"][0]["function"] == {"name": "bash", "arguments": '{"cmd":"ls"}'}
    assert called.usage.completion_tokens > 0


def test_counted_prompt_tokens_follow_openais_accounting(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    """With no usage from the trainer, the prompt count follows OpenAI's documented recipe (the cookbook's
    num_tokens_from_messages): 3 tokens per message plus every value in it, role included, plus 3 for the reply."""
    messages = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is two plus two?"},
    ]
    episode = trainer.create_episode()
    answer = background(ask_as, episode, messages)
    trainer.reply(pull_one(trainer, episode.id).id, "four")
    usage = answer.result(timeout=10).usage

    encoding = tiktoken.encoding_for_model(MODEL)
    expected = 3 + sum(3 + sum(len(encoding.encode(value)) for value in message.values()) for message in messages)
    assert usage.completion_tokens == len(encoding.encode("four"))
    assert usage.prompt_tokens == expected


# 4. Bad input


BAD_AGENT_BODIES = [
    (b'{"model": "gpt-4o", "messages": [', "not valid JSON"),
    (b"", "not valid JSON"),
    (b'{"model": "gpt-4o", "messages": "hello"}', "messages"),
    (b'{"model": "gpt-4o", "messages": []}', "messages"),
    (b'{"model": "gpt-4o", "messages": [{"content": "no role"}]}', "role"),
    (b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "stream"),
    (b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "n": 2}', "n=1"),
    (b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "tools": {}}', "tools"),
    (b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "tools": [5]}', "tools"),
    (b'{"model": "gpt-4o", "messages": [{"role": "banana", "content": "hi"}]}', "role must be one of"),
    (b'{"model": "gpt-4o", "messages": [{"role": "user", "content": {"nested": [1]}}]}', "content must be"),
    (b'{"model": 7, "messages": [{"role": "user", "content": "hi"}]}', "model"),
    (b'{"model": "gpt-4o"}', "messages"),
    (b'[{"role": "user", "content": "hi"}]', "JSON object"),
    (b'"just a string"', "JSON object"),
]


def test_malformed_agent_requests_are_400_and_record_nothing(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    answer = background(ask_as, episode)
    trainer.reply(pull_one(trainer, episode.id).id, "fine")
    answer.result(timeout=10)
    before = snapshot(server, episode.id)

    headers = {"authorization": f"Bearer {episode.key}", "content-type": "application/json"}
    for body, hint in BAD_AGENT_BODIES:
        response = api(server, "POST", "/v1/chat/completions", content=body, headers=headers)
        error = error_of(response, 400, "invalid_request_error")
        assert hint in error["message"], (body, error)

    with pytest.raises(openai.BadRequestError) as refused:
        ask_as(episode, n=2)
    assert "n=1" in str(refused.value)

    assert snapshot(server, episode.id) == before
    assert trainer.next_turns(wait_s=0) == []

    # and the episode still works
    answer = background(ask_as, episode)
    trainer.reply(pull_one(trainer, episode.id).id, "still here")
    assert answer.result(timeout=10).choices[0].message.content == "still here"
    assert [t.seq for t in trainer.trajectory(episode.id).turns] == [0, 1]


def test_malformed_trainer_requests_are_refused_and_record_nothing(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    answer = background(ask_as, episode)
    turn = pull_one(trainer, episode.id)
    before = snapshot(server, episode.id)
    json_headers = {"content-type": "application/json"}

    for path in (
        "/api/episodes",
        f"/api/episodes/{episode.id}/rewards",
        f"/api/episodes/{episode.id}/finish",
        f"/api/turns/{turn.id}/reply",
    ):
        for body in (b'{"value": ', b"{'single': 'quotes'}", b"nope"):
            error = error_of(api(server, "POST", path, content=body, headers=json_headers), 400)
            assert "JSON" in error["message"], (path, error)

    wrong_shapes = [
        ("/api/episodes", {"task": ["not", "a", "string"]}, "task"),
        ("/api/episodes", {"metadata": "flat"}, "metadata"),
        ("/api/episodes", {"turn_timeout_s": -1}, "turn_timeout_s"),
        ("/api/episodes", {"surprise": 1}, "surprise"),
        ("/api/episodes", [1, 2], "body"),
        (f"/api/episodes/{episode.id}/rewards", {"name": "r"}, "value"),
        (f"/api/episodes/{episode.id}/rewards", {"value": "high"}, "value"),
        (f"/api/episodes/{episode.id}/rewards", {"value": 1, "name": ""}, "name"),
        (f"/api/episodes/{episode.id}/finish", {"status": "done"}, "status"),
        (f"/api/turns/{turn.id}/reply", {"message": {"content": 5}}, "content"),
        (f"/api/turns/{turn.id}/reply", {"message": {"role": "user", "content": "hi"}}, "role"),
        (f"/api/turns/{turn.id}/reply", {"message": {"content": "x"}, "finish_reason": "bored"}, "finish_reason"),
        (f"/api/turns/{turn.id}/reply", {"message": {"content": "x"}, "usage": {"prompt_tokens": -1}}, "usage"),
        (f"/api/turns/{turn.id}/reply", {"error": {"status": 200, "message": "fine"}}, "status"),
    ]
    for path, shape, hint in wrong_shapes:
        error = error_of(api(server, "POST", path, json=shape), 422, "invalid_request_error")
        assert hint in error["message"], (path, shape, error)

    assert snapshot(server, episode.id) == before
    assert [e.id for e in trainer.episodes().episodes] == [episode.id]
    assert trainer.turn(turn.id).status == "leased"
    trainer.reply(turn.id, "answered at last")
    assert answer.result(timeout=10).choices[0].message.content == "answered at last"


def test_agent_keys_that_are_missing_unknown_or_finished_are_refused(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    before = snapshot(server, episode.id)
    base = episode.env["OPENAI_BASE_URL"]

    error = error_of(api(server, "POST", "/v1/chat/completions", json={"messages": HELLO}), 401, "authentication_error")
    assert "key" in error["message"]
    for headers in ({"authorization": "Bearer tpk-unknown"}, {"x-api-key": "tpk-unknown"}, {"authorization": "Bearer"}):
        response = api(server, "POST", "/v1/chat/completions", json={"messages": HELLO}, headers=headers)
        error_of(response, 401, "authentication_error")
    error_of(api(server, "POST", "/e/tpk-unknown/v1/chat/completions", json={"messages": HELLO}), 401)
    with (
        openai.OpenAI(base_url=base, api_key="tpk-" + "0" * 43, max_retries=0) as stranger,
        pytest.raises(openai.AuthenticationError),
    ):
        ask(stranger)
    # a bad key is refused before the body is even looked at
    error_of(api(server, "POST", "/v1/chat/completions", content=b"{", token="tpk-unknown"), 401)

    assert snapshot(server, episode.id) == before

    trainer.finish(episode.id, "finished", reason="graded")
    finished = snapshot(server, episode.id)
    with pytest.raises(openai.APIStatusError) as gone:
        ask_as(episode)
    assert gone.value.status_code == 410
    response = api(server, "POST", "/v1/chat/completions", json={"messages": HELLO}, token=episode.key)
    error = error_of(response, 410, "episode_closed")
    assert "finished" in error["message"]
    assert snapshot(server, episode.id) == finished


@pytest.mark.settings(max_body_bytes=2000)
def test_bodies_over_the_limit_are_413_on_agent_and_trainer_routes(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    answer = background(ask_as, episode)
    turn = pull_one(trainer, episode.id)
    before = snapshot(server, episode.id)
    big = "x" * 3000

    with pytest.raises(openai.APIStatusError) as too_big:
        ask_as(episode, [{"role": "user", "content": big}])
    assert too_big.value.status_code == 413
    agent_body = json.dumps({"messages": [{"role": "user", "content": big}]}).encode()
    error = error_of(
        api(server, "POST", "/v1/chat/completions", content=agent_body, token=episode.key), 413, "request_too_large"
    )
    assert "2000" in error["message"]
    error_of(
        api(
            server,
            "POST",
            "/v1/chat/completions",
            content=chunks(agent_body),
            token=episode.key,
            headers={"content-type": "application/json"},
        ),
        413,
        "request_too_large",
    )

    for path, body in [
        ("/api/episodes", {"task": big}),
        (f"/api/episodes/{episode.id}/rewards", {"value": 1, "info": {"log": big}}),
        (f"/api/episodes/{episode.id}/finish", {"reason": big}),
        (f"/api/turns/{turn.id}/reply", {"message": {"content": big}}),
    ]:
        error = error_of(api(server, "POST", path, json=body), 413, "request_too_large")
        assert "2000" in error["message"], error
    with pytest.raises(TrajproxyAPIError) as refused:
        trainer.reply(turn.id, big)
    assert refused.value.status == 413

    assert snapshot(server, episode.id) == before
    assert [e.id for e in trainer.episodes().episodes] == [episode.id]
    trainer.reply(turn.id, "small enough")
    assert answer.result(timeout=10).choices[0].message.content == "small enough"


@pytest.mark.settings(max_body_bytes=2000)
def test_chunked_bodies_over_the_limit_are_413_on_trainer_routes(server: Any, trainer: TrainerClient) -> None:
    """Without a Content-Length (chunked transfer encoding) the limit must hold all the same."""
    big = json.dumps({"task": "x" * 3000, "metadata": {}}).encode()
    response = api(server, "POST", "/api/episodes", content=chunks(big), headers={"content-type": "application/json"})
    error_of(response, 413, "request_too_large")
    assert trainer.episodes().episodes == []


def test_reply_to_an_unknown_turn_is_404(server: Any, trainer: TrainerClient) -> None:
    with pytest.raises(TrajproxyAPIError) as refused:
        trainer.reply("tu_doesnotexist", "hi")
    assert refused.value.status == 404
    assert refused.value.kind == "not_found_error"
    assert "tu_doesnotexist" in refused.value.message
    error_of(api(server, "POST", "/api/turns/tu_doesnotexist/reply", json={"message": {"content": "x"}}), 404)


def test_a_reply_needs_exactly_one_of_message_or_error(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    answer = background(ask_as, episode)
    turn = pull_one(trainer, episode.id)
    before = snapshot(server, episode.id)

    for body in (
        {"message": {"content": "hi"}, "error": {"status": 500, "message": "boom"}},
        {},
        {"finish_reason": "stop"},
        {"message": None, "error": None},
    ):
        error = error_of(api(server, "POST", f"/api/turns/{turn.id}/reply", json=body), 422, "invalid_request_error")
        assert "exactly one of 'message' or 'error'" in error["message"], error

    assert snapshot(server, episode.id) == before
    assert not answer.done()
    trainer.reply(turn.id, "ok")
    assert answer.result(timeout=10).choices[0].message.content == "ok"


def test_replies_are_idempotent_and_cannot_be_changed(
    server: Any, trainer: TrainerClient, lane: Lane, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    answer = background(ask_as, episode)
    [turn] = lane.pull(episode.id, wait_s=5)
    first = lane.reply(turn.id, "once", lease_id=turn.lease_id)
    assert answer.result(timeout=10).choices[0].message.content == "once"
    after = snapshot(server, episode.id)

    again = lane.reply(turn.id, "once", lease_id=turn.lease_id)
    assert again.status == "answered"
    assert again.answered_at == first.answered_at
    with pytest.raises(TrajproxyAPIError) as changed:
        lane.reply(turn.id, "twice")
    assert changed.value.status == 409
    assert "different reply" in changed.value.message
    assert snapshot(server, episode.id) == after


@pytest.mark.settings(turn_timeout_s=0.5)
def test_reply_to_an_expired_turn_is_409(
    server: Any, trainer: TrainerClient, lane: Lane, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    with pytest.raises(openai.APIStatusError) as timed_out:
        ask_as(episode)
    assert timed_out.value.status_code == 504
    assert error_body(timed_out.value.body)["type"] == "timeout_error"

    before = snapshot(server, episode.id)
    [expired] = before["turns"]
    assert expired["status"] == "expired"
    assert expired["reply"] is None
    assert lane.pull(wait_s=0) == []

    with pytest.raises(TrajproxyAPIError) as late:
        lane.reply(expired["id"], "too late")
    assert late.value.status == 409
    assert late.value.kind == "turn_closed"
    assert "expired" in late.value.message
    error_of(api(server, "POST", f"/api/turns/{expired['id']}/reply", json={"message": {"content": "x"}}), 409)
    assert snapshot(server, episode.id) == before


def test_unknown_routes_are_404_in_the_error_shape(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    for method, path in [
        ("GET", "/nope"),
        ("POST", "/v1/completions"),
        ("GET", "/api/nope"),
        ("POST", "/api/episodes/x/y/z"),
        ("GET", "/v2/chat/completions"),
    ]:
        token = AS_TRAINER if path.startswith("/api/") else episode.key  # each side's own credentials
        error = error_of(api(server, method, path, token=token), 404, "not_found_error")
        assert path in error["message"], error


def test_the_key_in_the_path_works_and_is_never_echoed(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    with openai.OpenAI(
        base_url=f"{server.url}/e/{episode.key}/v1", api_key="ignored-by-the-proxy", max_retries=0
    ) as agent:
        assert [m.id for m in agent.models.list()] == ["trajproxy"]
        answer = background(ask, agent)
        turn = pull_one(trainer, episode.id)
        trainer.reply(turn.id, "via the path")
        assert answer.result(timeout=10).choices[0].message.content == "via the path"
        assert [t.id for t in trainer.trajectory(episode.id).turns] == [turn.id]

        for method, path in [("GET", f"/e/{episode.key}/nope"), ("POST", f"/e/{episode.key}/v1/nothing-here")]:
            response = api(server, method, path)
            error = error_of(response, 404, "not_found_error")
            assert episode.key not in response.text
            assert "/e/<key>/" in error["message"]
        response = api(server, "GET", f"/e/{episode.key}/v1/chat/completions")
        assert response.status_code == 405
        assert episode.key not in response.text


# 5. Trainer token


def every_api_route(episode_id: str, turn_id: str) -> list[tuple[str, str, Any]]:
    return [
        ("POST", "/api/episodes", {"task": "sneaky"}),
        ("GET", "/api/episodes", None),
        ("GET", f"/api/episodes/{episode_id}", None),
        ("POST", f"/api/episodes/{episode_id}/finish", {"status": "cancelled"}),
        ("POST", f"/api/episodes/{episode_id}/rewards", {"value": 1.0}),
        ("POST", f"/api/episodes/{episode_id}/rewards", {"value": 1.0, "turn_id": turn_id}),
        ("GET", f"/api/episodes/{episode_id}/trajectory", None),
        ("POST", f"/api/episodes/{episode_id}/fork", {"at_turn": 0, "n": 2}),
        ("POST", f"/api/episodes/{episode_id}/reset?wait=0", {}),
        ("POST", f"/api/episodes/{episode_id}/step?wait=0", {"message": {"content": "sneaky"}, "turn_id": turn_id}),
        ("GET", f"/api/turns/next?episode={episode_id}&max=8", None),
        ("GET", "/api/turns/next?wait=2", None),
        ("GET", f"/api/turns/{turn_id}", None),
        ("POST", f"/api/turns/{turn_id}/reply", {"message": {"content": "not from the trainer"}}),
        ("POST", f"/api/turns/{turn_id}/forward", {"model": "openai/not-from-the-trainer"}),
        ("POST", "/api/turns/replies", {"replies": [{"turn_id": turn_id, "message": {"content": "sneaky"}}]}),
        ("POST", "/api/pause", {"mode": "reject"}),
        ("POST", "/api/resume", {}),
    ]


@pytest.mark.settings(trainer_token=TOKEN)
def test_the_trainer_token_guards_every_api_route(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    answer = background(ask_as, episode)  # the agent still gets in with its episode key
    [parked] = wait_parked(trainer, episode.id)
    before = snapshot(server, episode.id, TOKEN)
    routes = every_api_route(episode.id, parked.id)

    # the list above covers every route the trainer API serves (as its OpenAPI schema lists them)
    schema = httpx.get(f"{server.url}/api/openapi.json", timeout=10).json()
    served = {(method.upper(), path) for path, ops in schema["paths"].items() for method in ops}
    assert len(served) >= 9
    covered = {
        (method, path.partition("?")[0].replace(episode.id, "{episode_id}").replace(parked.id, "{turn_id}"))
        for method, path, _ in routes
    }
    assert covered == served

    refusals = [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": f"Bearer {TOKEN}x"},
        {"authorization": f"Bearer {episode.key}"},
        {"authorization": f"Basic {TOKEN}"},
        {"authorization": TOKEN},
        {"x-api-key": TOKEN},
        {"x-api-key": episode.key},
    ]
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for method, path, body in routes:
            for headers in refusals:
                response = http.request(method, path, json=body, headers=headers)
                error = error_of(response, 401, "authentication_error")
                assert "TRAJPROXY_TRAINER_TOKEN" in error["message"], error
                assert episode.key not in response.text
                assert TOKEN not in response.text

    assert snapshot(server, episode.id, TOKEN) == before
    assert [e.id for e in trainer.episodes().episodes] == [episode.id]
    assert trainer.turn(parked.id).status == "parked"
    assert not answer.done()

    # the real trainer, token and all, is served
    turn = pull_one(trainer, episode.id)
    assert turn.id == parked.id
    assert turn.deliveries == 1  # none of the refused pulls leased it
    trainer.reply(turn.id, "from the trainer")
    assert answer.result(timeout=10).choices[0].message.content == "from the trainer"
    trainer.add_reward(episode.id, 1.0)
    assert trainer.finish(episode.id).status == "finished"


@pytest.mark.settings(trainer_token=TOKEN)
def test_the_trainer_token_is_checked_before_the_body_is_read(server: Any, trainer: TrainerClient) -> None:
    """An unauthenticated caller learns nothing about the body (400/413/422): it gets 401 first."""
    episode = trainer.create_episode()
    json_headers = {"content-type": "application/json"}
    for path in ("/api/episodes", f"/api/episodes/{episode.id}/rewards", f"/api/episodes/{episode.id}/finish"):
        for content in (b"{not json", b'{"value": NaN}', b"[]"):
            response = api(server, "POST", path, None, content=content, headers=json_headers)
            error_of(response, 401, "authentication_error")
    assert [e.id for e in trainer.episodes().episodes] == [episode.id]


@pytest.mark.settings(trainer_token=TOKEN)
def test_with_a_token_agents_still_use_their_episode_key(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    assert api(server, "GET", "/api/episodes", TOKEN).status_code == 200
    with (
        agent_for(episode) as by_bearer,
        openai.OpenAI(base_url=f"{server.url}/e/{episode.key}/v1", api_key="x", max_retries=0) as by_path,
        openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0) as with_the_token,
    ):
        for agent in (by_bearer, by_path):
            answer = background(ask, agent)
            trainer.reply(pull_one(trainer, episode.id).id, "served")
            assert answer.result(timeout=10).choices[0].message.content == "served"
        # the trainer token is not an episode key
        with pytest.raises(openai.AuthenticationError):
            ask(with_the_token)
    assert len(trainer.trajectory(episode.id).turns) == 2


# 6. Isolation


@pytest.mark.settings(trainer_token=TOKEN)
def test_an_episode_key_cannot_drive_the_trainer_api(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    a = trainer.create_episode(task="A")
    b = trainer.create_episode(task="B")
    answer_a = background(ask_as, a)
    answer_b = background(ask_as, b)
    turn_a = pull_one(trainer, a.id)
    turn_b = pull_one(trainer, b.id)
    before = {e: snapshot(server, e, TOKEN) for e in (a.id, b.id)}

    for key in (a.key, b.key):
        with TrainerClient(server.url, token=key) as impostor:
            for attempt in (
                lambda: impostor.reply(turn_b.id, "hijacked"),
                lambda: impostor.reply(turn_a.id, "self-answered"),
                lambda: impostor.trajectory(b.id),
                lambda: impostor.episode(b.id),
                lambda: impostor.turn(turn_b.id),
                lambda: impostor.finish(b.id, "failed"),
                lambda: impostor.finish(a.id, "finished"),
                lambda: impostor.add_reward(a.id, 100.0),
                lambda: impostor.add_reward(b.id, -100.0, turn_id=turn_b.id),
                lambda: impostor.next_turns(wait_s=0),
                lambda: impostor.episodes(),
                lambda: impostor.create_episode(),
            ):
                with pytest.raises(TrajproxyAPIError) as refused:
                    attempt()
                assert refused.value.status == 401
                assert refused.value.kind == "authentication_error"

    assert {e: snapshot(server, e, TOKEN) for e in (a.id, b.id)} == before
    assert not answer_a.done()
    assert not answer_b.done()
    trainer.reply(turn_a.id, "for A")
    trainer.reply(turn_b.id, "for B")
    assert answer_a.result(timeout=10).choices[0].message.content == "for A"
    assert answer_b.result(timeout=10).choices[0].message.content == "for B"


def test_calls_land_only_in_their_own_episode(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    a = trainer.create_episode(task="A")
    b = trainer.create_episode(task="B")
    with (
        agent_for(a) as agent_a,
        openai.OpenAI(base_url=f"{server.url}/e/{a.key}/v1", api_key=b.key, max_retries=0) as by_path_a,
        agent_for(b) as agent_b,
    ):
        calls = [
            (agent_a, a, "from A, bearer"),
            (by_path_a, a, "from A, path key wins over a header"),
            (agent_b, b, "from B"),
            (agent_a, a, "from A again"),
        ]
        for agent, episode, text in calls:
            answer = background(ask, agent, [{"role": "user", "content": text}])
            assert trainer.next_turns(episode=(b if episode is a else a).id, wait_s=0) == []
            turn = pull_one(trainer, episode.id)
            assert turn.episode_id == episode.id
            assert turn.request["messages"][0]["content"] == text
            trainer.reply(turn.id, f"answer to {text}")
            assert answer.result(timeout=10).choices[0].message.content == f"answer to {text}"

    trainer.add_reward(a.id, 1.0, "a_only")
    trajectory_a = trainer.trajectory(a.id)
    trajectory_b = trainer.trajectory(b.id)
    assert [t.request["messages"][0]["content"] for t in trajectory_a.turns] == [
        "from A, bearer",
        "from A, path key wins over a header",
        "from A again",
    ]
    assert [t.seq for t in trajectory_a.turns] == [0, 1, 2]
    assert [t.request["messages"][0]["content"] for t in trajectory_b.turns] == ["from B"]
    assert [t.seq for t in trajectory_b.turns] == [0]
    assert all(t.episode_id == a.id for t in trajectory_a.turns)
    assert all(t.episode_id == b.id for t in trajectory_b.turns)
    assert [r.name for r in trajectory_a.rewards] == ["a_only"]
    assert trajectory_b.rewards == []


# 7. The trainer's error reply


def test_an_error_reply_reaches_the_sdk_as_its_own_exception(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    answer = background(ask_as, episode)
    turn = pull_one(trainer, episode.id)
    replied = trainer.reply(turn.id, error={"status": 429, "message": "slow down", "type": "rate_limit_error"})
    assert replied.status == "answered"

    with pytest.raises(openai.RateLimitError) as limited:
        answer.result(timeout=10)
    assert limited.value.status_code == 429
    assert error_body(limited.value.body)["message"] == "slow down"
    assert error_body(limited.value.body)["type"] == "rate_limit_error"
    assert "slow down" in limited.value.message

    [recorded] = trainer.trajectory(episode.id).turns
    assert recorded.reply is not None
    assert recorded.reply.message is None
    assert recorded.reply.error is not None
    assert recorded.reply.error.model_dump() == {"status": 429, "message": "slow down", "type": "rate_limit_error"}
    assert recorded.reply.usage is None

    # the episode carries on after the error
    answer = background(ask_as, episode)
    trainer.reply(pull_one(trainer, episode.id).id, "better now")
    assert answer.result(timeout=10).choices[0].message.content == "better now"


def test_two_servers_in_one_process_share_one_framework_app_and_each_answers_from_its_own_database(
    make_server: Callable[..., Any], tmp_path: Any
) -> None:
    """The process's FastAPI app serves every server's trainer API (`proxy.http.trainer.for_every_app`): each request
    is answered by the handlers of the server it reached, over that server's database, never another's."""
    first = make_server()
    running = start_server(
        Settings(_env_file=None, database_url=f"sqlite:///{tmp_path}/2.db", trainer_token=new_token())
    )
    second = running.live
    try:
        with TrainerClient(first.url, token=first.token) as one, TrainerClient(second.url, token=second.token) as two:
            made = one.create_episode(task="the first's")
            assert [e.id for e in one.episodes().episodes] == [made.id]
            assert two.episodes().episodes == []
            with pytest.raises(TrajproxyAPIError) as unknown:
                two.episode(made.id)
            assert unknown.value.status == 404
            other = two.create_episode(task="the second's")
            assert [e.id for e in two.episodes().episodes] == [other.id]
            assert one.episode(made.id).task == "the first's"
    finally:
        running.stop()
    (served,) = {framework_app(server.app.table) for server in (first, second)}
    assert isinstance(served, FastAPI)


# A reply's fields for the agent in shapes its dialect could not render (each crashed a dialect's rendering: a
# 500, a cut stream or an SDK's error for the agent, after the reply was recorded), and what the 422 says.
UNRENDERABLE: list[tuple[dict[str, Any], str]] = [
    ({"reasoning_content": {"not": "text"}}, "reasoning_content must be a string or null, not dict"),
    ({"thinking_blocks": "abc"}, "thinking_blocks must be a list of thinking blocks"),
    ({"thinking_blocks": [{"thinking": "no type"}]}, "thinking_blocks must be a list of thinking blocks"),
    ({"thinking_blocks": [{"type": "text"}]}, "thinking_blocks must be a list of thinking blocks"),
    ({"thinking_blocks": [{"type": "thinking", "thinking": 5}]}, "thinking and signature must be strings"),
    ({"reasoning_items": 5}, "reasoning_items must be a list of reasoning items"),
    ({"reasoning_items": [{"id": "rs_1"}]}, "reasoning_items must be a list of reasoning items"),
    ({"reasoning_items": [{"type": "message"}]}, "reasoning_items must be a list of reasoning items"),
]


def test_a_replys_fields_for_the_agent_in_a_shape_no_dialect_renders_are_refused(
    server: Any, trainer: TrainerClient, lane: Lane, background: Callable[..., Future[Any]]
) -> None:
    episode = trainer.create_episode()
    answer = background(ask_as, episode)
    [turn] = lane.pull(episode.id, wait_s=5)
    before = snapshot(server, episode.id)
    for extras, says in UNRENDERABLE:
        with pytest.raises(TrajproxyAPIError) as refused:
            lane.reply(turn.id, message={"content": "hi", **extras}, lease_id=turn.lease_id)
        assert refused.value.status == 422 and says in refused.value.message, (extras, refused.value)
        assert "\n" not in refused.value.message
    assert snapshot(server, episode.id) == before
    thought = {"type": "thinking", "thinking": "hm", "signature": "s"}
    rendered = {"reasoning_content": "hm", "thinking_blocks": [thought], "reasoning_items": [{"type": "reasoning"}]}
    lane.reply(turn.id, message={"content": "hi", **rendered}, lease_id=turn.lease_id)
    assert answer.result(timeout=10).choices[0].message.content == "hi"
