"""Security, end to end: episode keys, isolation between episodes, the trainer token, request limits, logs and the
sandbox. Each point names the tests that prove it; where another module already proves a part, it is named, not
repeated.

1. Episode keys have at least 128 bits of randomness, are stored hashed and compared in constant time.
   - test_episode_keys_are_256_random_bits_and_never_repeat: keys handed out by the API (SQLite and Postgres) have
     the exact shape of `secrets.token_urlsafe(32)` (32 random bytes), never repeat, and their bits look uniform.
   - test_the_key_generator_is_the_secrets_module: the generator's own code.
   - test_the_database_holds_the_keys_hash_never_the_key: after a key was used every way an agent can use it, the
     raw SQLite files and every row of every table (SQLite and Postgres) hold its SHA-256, never the key.
   - test_secrets_are_compared_with_hmac_compare_digest: checked on the compiled code, not with a stopwatch. What
     makes a comparison constant-time is the primitive it calls; the leak it prevents is nanoseconds per byte, far
     below the noise of a shared test machine, so a timing test could only pass by luck or flake. The test checks
     that `same_secret` is `hmac.compare_digest` and that the two places a secret is checked (the trainer token in
     the gate, the episode key in the broker) call it and make no `==` of their own. (An episode key is looked up
     by its SHA-256, so a lookup's timing could at most tell something about a hash of a 256-bit secret.)
2. No key of one episode can read, answer, finish or reward another.
   - test_an_episode_key_opens_no_trainer_route: with a trainer token, A's key, in every header and in the path,
     on every route of the trainer API (checked against its OpenAPI schema) naming B's ids or its own, is refused,
     and nothing of A or B changes (no lease, no reply, no reward, no finish, no pause).
   - test_an_episode_key_opens_no_trainer_route_over_the_sandbox_socket: the same with no token at all, from where
     sandboxed agents connect.
   - test_calls_land_only_in_the_keys_episode_in_every_dialect: chat, responses and messages, with the key as a
     bearer token, as x-api-key, and in the path (which wins over another episode's key in a header).
   - test_a_key_cannot_continue_or_replay_another_episodes_turns: B's response id as previous_response_id, and
     SDK retries of B's exact bodies (answered or still parked), never reach B's turns or replies.
   Also: tests/test_trainer_api.py::test_an_episode_key_cannot_drive_the_trainer_api, ::test_calls_land_only_in_
   their_own_episode, ::test_reward_for_another_episodes_turn_or_an_unknown_episode_is_404, and
   tests/test_responses_sdk.py::test_previous_response_id_rebuilds_the_conversation.
3. The trainer API needs its token on any non-loopback bind: the real `trajproxy serve` on 0.0.0.0, on :: and on
   this machine's own address.
   - test_a_non_loopback_bind_without_a_token_does_not_start: no token, an empty one or a blank one.
   - test_a_non_loopback_bind_with_a_token_guards_the_trainer_api: reached at that address, /api is 401 without
     the token, with a wrong one and with an episode key.
   Also: tests/test_cli.py::test_refuses_a_public_address_without_a_trainer_token, ::test_a_public_address_with_a_
   trainer_token_starts_and_guards_the_trainer_api.
4. Body size and JSON nesting limits.
   - test_bodies_over_the_limit_are_413_on_every_route_however_framed: every agent route (each key carrier) and
     every trainer route, with Content-Length and chunked; a body of exactly the limit is accepted.
   - test_deeply_nested_json_is_refused_clearly_on_trainer_routes: 129 to 100,000 levels, in every route's free-form
     fields, get a 400 (or 422) that says so; 32 levels are kept as sent.
   - test_deeply_nested_json_is_a_clear_400_on_agent_routes (expected to fail: agent routes take 255 to 1,024
     levels and then fail in storage with a 503).
   Also: tests/test_trainer_api.py::test_bodies_over_the_limit_are_413_on_agent_and_trainer_routes,
   ::test_chunked_bodies_over_the_limit_are_413_on_trainer_routes.
5. No keys or tokens in logs.
   - test_no_key_or_token_reaches_the_logs: the real server at --log-level debug, driven through served calls in
     every dialect and key carrier, refusals, bad keys and tokens, finished episodes, timeouts, expired leases,
     hang-ups, forwards and bad bodies; no key, token, or part of one, is in its output.
   Also: tests/test_trainer_api.py::test_the_key_in_the_path_works_and_is_never_echoed,
   ::test_get_episode_and_no_read_ever_returns_the_key (responses, not logs).
6. Sandbox hardening (Docker). What sandbox/ applies: all capabilities dropped, no-new-privileges, a network on
   which only the proxy is reachable, memory (without swap), CPU and pids limits, for the agent and for its gate.
   It promises no non-root user and no read-only root file system (task images run their agents as root and
   write their repositories), so the agent is root in name only: the tests show that root can do nothing a
   capability would allow.
   - test_the_agent_and_its_gate_run_without_privileges
   - test_one_sandbox_cannot_reach_another
   Also: tests/test_sandbox.py::test_the_sandbox_reaches_nothing_but_the_proxy, ::test_limits_and_hardening_are_in_
   force (the agent with no network: cgroup limits, CapEff, NoNewPrivs, a fork bomb stopped).
"""

from __future__ import annotations

import asyncio
import base64
import dis
import hashlib
import hmac
import ipaddress
import json
import math
import re
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import sqlalchemy

from proxy.client import TrainerClient, TrajproxyAPIError
from proxy.core.broker import Broker
from proxy.core.values import new_key, same_secret
from proxy.http.edge import MAX_JSON_DEPTH
from proxy.http.routes import Router
from proxy.storage.engines import engine_url
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.backends.interface import Limits, SandboxSpec
from tests.test_cli import START_S, clean_env, free_port, run_cli, serving

MODEL = "gpt-4o"
HELLO = [{"role": "user", "content": "hello"}]
TOKEN = "trainer-" + secrets.token_hex(16)
KEY = re.compile(r"tpk-[A-Za-z0-9_-]{43}")  # the prefix, then secrets.token_urlsafe(32): 32 bytes, unpadded
IMAGE = "python:3.11-slim"


# Helpers


def request(base: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, base + path, timeout=10, **kwargs)


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def json_as(secret: str) -> dict[str, str]:
    """A trainer's headers for a raw JSON body (the trainer API takes no other type)."""
    return {**bearer(secret), "content-type": "application/json"}


def message_of(response: httpx.Response, status: int) -> str:
    """The error message of a refusal in either dialect's shape (OpenAI's, used by the trainer API, or
    Anthropic's), after checking its status."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    message = body["error"]["message"]
    assert isinstance(message, str) and len(message) > 10, body
    return message


def snapshot(base: str, episode_id: str, token: str | None = None) -> dict[str, Any]:
    """An episode's whole record (episode, turns, rewards) as raw JSON, for before/after comparisons."""
    response = request(base, "GET", f"/api/episodes/{episode_id}/trajectory", headers=bearer(token) if token else {})
    assert response.status_code == 200, response.text
    return dict(response.json())


def parked(trainer: TrainerClient, episode_id: str, count: int = 1) -> list[Any]:
    """The episode's turns once `count` are recorded (polling, not sleeping a fixed time)."""
    deadline = time.monotonic() + 10
    while len(turns := trainer.trajectory(episode_id).turns) < count:
        assert time.monotonic() < deadline, f"only {len(turns)} turns parked"
        time.sleep(0.02)
    return list(turns)


def pull_one(trainer: TrainerClient, episode_id: str | None = None, **kwargs: Any) -> Any:
    """The one turn waiting (in `episode_id`, or anywhere): exactly one must come."""
    turns = trainer.next_turns(episode=episode_id, max=8, wait_s=5, **kwargs)
    assert len(turns) == 1, turns
    return turns[0]


def chunked(data: bytes, size: int = 500) -> Iterator[bytes]:
    """A body sent with chunked transfer encoding (no Content-Length)."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


def chat_agent(base_url: str, key: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, **kwargs)


def ask(base_url: str, key: str, text: str = "hello", **options: Any) -> str | None:
    """One chat call by the agent holding `key`, on a client closed after it, answered or not."""
    with chat_agent(base_url, key, **options) as agent:
        reply = agent.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}])
    return reply.choices[0].message.content


def respond(base_url: str, key: str, text: str, **options: Any) -> Any:
    """One Responses call by the agent holding `key`, on a client closed after it."""
    with chat_agent(base_url, key) as agent:
        return agent.responses.create(model=MODEL, input=text, **options)


def ask_claude(base_url: str, key: str, text: str = "hello") -> anthropic.types.Message:
    """One Messages call by the agent holding `key`, on a client closed after it."""
    with anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0) as claude:
        return claude.messages.create(model="claude", max_tokens=10, messages=[{"role": "user", "content": text}])


def text_of(message: anthropic.types.Message) -> str:
    block = message.content[0]
    assert isinstance(block, anthropic.types.TextBlock), message
    return block.text


def trainer_routes(episode_id: str, turn_id: str) -> list[tuple[str, str, Any]]:
    """Every route of the trainer API, naming this episode and turn, with a body it would act on."""
    act = {"message": {"content": "hijacked"}}
    return [
        ("POST", "/api/episodes", {"task": "sneaky"}),
        ("GET", "/api/episodes", None),
        ("GET", f"/api/episodes/{episode_id}", None),
        ("POST", f"/api/episodes/{episode_id}/finish", {"status": "cancelled", "reason": "hijacked"}),
        ("POST", f"/api/episodes/{episode_id}/rewards", {"value": 100.0, "turn_id": turn_id}),
        ("GET", f"/api/episodes/{episode_id}/trajectory", None),
        ("POST", f"/api/episodes/{episode_id}/fork", {"at_turn": 0, "n": 3}),
        ("POST", f"/api/episodes/{episode_id}/reset?wait=0", {}),
        ("POST", f"/api/episodes/{episode_id}/step?wait=0", {"turn_id": turn_id, **act}),
        ("GET", f"/api/turns/next?episode={episode_id}&max=8", None),
        ("GET", f"/api/turns/{turn_id}", None),
        ("POST", f"/api/turns/{turn_id}/reply", act),
        ("POST", f"/api/turns/{turn_id}/forward", {"model": "openai/hijacked"}),
        ("POST", "/api/turns/replies", {"replies": [{"turn_id": turn_id, **act}]}),
        ("POST", "/api/pause", {"mode": "reject"}),
        ("POST", "/api/resume", {}),
    ]


def assert_every_route_is_listed(base: str, routes: list[tuple[str, str, Any]], episode_id: str, turn_id: str) -> None:
    """The routes listed are all the trainer API serves, as its own OpenAPI schema (served without a token) says."""
    schema = request(base, "GET", "/api/openapi.json").json()
    served = {(method.upper(), path) for path, operations in schema["paths"].items() for method in operations}
    listed = {
        (method, path.partition("?")[0].replace(episode_id, "{episode_id}").replace(turn_id, "{turn_id}"))
        for method, path, _ in routes
    }
    assert listed == served


def two_parked_episodes(
    trainer: TrainerClient,
    agent_base: str,
    background: Callable[..., Future[Any]],
    agent_http: Callable[[], httpx.Client] | None = None,
) -> tuple[Any, Any, Future[Any], Future[Any], Any, Any]:
    """Episodes A and B, each with one call parked (not pulled): (a, b, answer_a, answer_b, turn_a, turn_b). Each
    agent's SDK client is on an `agent_http()` of its own if given."""
    a = trainer.create_episode(task="A's task")
    b = trainer.create_episode(task="B's task")

    def own_http() -> dict[str, Any]:
        return {"http_client": agent_http()} if agent_http else {}

    answer_a = background(ask, agent_base, a.key, "A's private question", **own_http())
    answer_b = background(ask, agent_base, b.key, "B's private question", **own_http())
    [turn_a] = parked(trainer, a.id)
    [turn_b] = parked(trainer, b.id)
    return a, b, answer_a, answer_b, turn_a, turn_b


def assert_untouched_then_served(
    trainer: TrainerClient,
    base: str,
    before: dict[str, Any],
    calls: list[tuple[Any, Any, Future[Any]]],
    token: str | None = None,
) -> None:
    """Nothing recorded changed, nothing was leased, created or paused, and the real trainer still serves both."""
    assert {episode_id: snapshot(base, episode_id, token) for episode_id in before} == before
    assert {e.id for e in trainer.episodes().episodes} == set(before)
    assert request(base, "GET", "/health").json()["paused"] is None
    for _, turn, answer in calls:
        assert trainer.turn(turn.id).status == "parked"
        assert trainer.turn(turn.id).deliveries == 0
        assert not answer.done()
    for episode, turn, answer in calls:
        assert pull_one(trainer, episode.id).id == turn.id
        trainer.reply(turn.id, f"for {episode.task}")
        assert answer.result(timeout=10) == f"for {episode.task}"


def names_in(function: Any) -> list[str]:
    """The globals and attributes the function's compiled code loads, in order: what it really runs, not the
    source on disk."""
    loads = ("LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD")
    return [str(i.argval) for i in dis.get_instructions(function) if i.opname in loads]


def equality_tests_in(function: Any) -> list[str]:
    return [
        str(i.argval) for i in dis.get_instructions(function) if i.opname == "COMPARE_OP" and i.argval in ("==", "!=")
    ]


# 1. Episode keys


KEYS = 200


def test_episode_keys_are_256_random_bits_and_never_repeat(trainer: TrainerClient) -> None:
    handed_out = [trainer.create_episode().key for _ in range(KEYS)]
    assert all(KEY.fullmatch(key) for key in handed_out), handed_out[:3]
    assert len(set(handed_out)) == KEYS

    # 43 url-safe base64 characters are the unpadded encoding of exactly 32 bytes: 256 bits, at most 258 by
    # the alphabet alone, either way far above 128.
    raw = [base64.urlsafe_b64decode(key.removeprefix("tpk-") + "=") for key in handed_out]
    assert {len(r) for r in raw} == {32}
    assert [base64.urlsafe_b64encode(r).rstrip(b"=").decode() for r in raw] == [k[4:] for k in handed_out]

    # The bits look uniformly random (each bound is six standard deviations: a false alarm is about 1e-9):
    # half of them are ones, every byte value is about as frequent, and no byte position is fixed or counted
    # (a clock or a counter in a key would leave a position with few values).
    bits = 256 * KEYS
    ones = sum(bin(int.from_bytes(r, "big")).count("1") for r in raw)
    assert abs(ones - bits / 2) < 6 * math.sqrt(bits) / 2
    counts = [0] * 256
    for r in raw:
        for byte in r:
            counts[byte] += 1
    expected = 32 * KEYS / 256
    chi_square = sum((count - expected) ** 2 / expected for count in counts)
    assert chi_square < 415  # 255 degrees of freedom: the 1e-9 upper tail starts near 415
    for position in range(32):
        assert len({r[position] for r in raw}) > 100  # about 139 distinct values expected from 200 draws
    assert len({r[:4] for r in raw}) == KEYS  # not even 32 bits in common at the start


def test_the_key_generator_is_the_secrets_module() -> None:
    """The key comes from the operating system's CSPRNG (`secrets`), never from `random` (which makes ids)."""
    names = names_in(new_key)
    assert names[names.index("secrets") + 1] == "token_urlsafe"
    assert new_key.__globals__["secrets"] is secrets
    assert not {"random", "getrandbits", "choice", "choices"} & set(names)
    [size] = [c for c in new_key.__code__.co_consts if isinstance(c, int)]
    assert size * 8 >= 128
    assert KEY.fullmatch(new_key())


def database_text(database_url: str) -> str:
    """Every row of every table, as text: what anyone reading the database would see."""
    engine = sqlalchemy.create_engine(engine_url(database_url))
    try:
        with engine.connect() as conn:
            tables = sqlalchemy.inspect(conn).get_table_names()
            assert {"episode", "turn", "reward"} <= set(tables)
            return "\n".join(
                repr(tuple(row))
                for table in tables
                for row in conn.execute(sqlalchemy.text(f'SELECT * FROM "{table}"'))
            )
    finally:
        engine.dispose()


def test_the_database_holds_the_keys_hash_never_the_key(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]], database_url: str
) -> None:
    episode = trainer.create_episode(task="hashed")
    finished = trainer.create_episode(task="finished")
    key_hash = hashlib.sha256(episode.key.encode()).hexdigest()

    # The key used every way an agent can use it, in every dialect; then rewards, a refusal and a finish.
    base = server.url
    calls: list[Callable[[], Any]] = [
        lambda: ask(f"{base}/v1", episode.key),
        lambda: ask(f"{base}/e/{episode.key}/v1", "not-the-key"),
        lambda: respond(f"{base}/v1", episode.key, "hello"),
        lambda: ask_claude(base, episode.key),
    ]
    for call in calls:
        answer = background(call)
        trainer.reply(pull_one(trainer, episode.id).id, "ok")
        answer.result(timeout=10)
    counted = request(
        base,
        "POST",
        "/v1/messages/count_tokens",
        headers={"x-api-key": episode.key},
        json={"model": "c", "messages": HELLO},
    )
    assert counted.status_code == 200, counted.text
    trainer.add_reward(episode.id, 1.0, info={"note": "graded"})
    trainer.finish(finished.id)
    refused = request(base, "POST", "/v1/chat/completions", headers=bearer(finished.key), json={"messages": HELLO})
    assert refused.status_code == 410
    trainer.finish(episode.id)
    assert [t.status for t in trainer.trajectory(episode.id).turns] == ["answered"] * 4

    rows = database_text(database_url)
    assert "graded" in rows and rows.count(episode.id) >= 6  # the episode, its four turns and its reward
    for key in (episode.key, finished.key):
        assert key not in rows
        assert key.removeprefix("tpk-") not in rows
        assert hashlib.sha256(key.encode()).hexdigest() in rows
    if database_url.startswith("sqlite:///"):
        files = list(Path(database_url.removeprefix("sqlite:///")).parent.glob("trajproxy.db*"))
        raw = b"".join(path.read_bytes() for path in files)
        assert key_hash.encode() in raw  # the writes are on disk (database file or its write-ahead log)
        for key in (episode.key, finished.key):
            assert key.removeprefix("tpk-").encode() not in raw


def test_secrets_are_compared_with_hmac_compare_digest() -> None:
    names = names_in(same_secret)
    assert names[names.index("hmac") + 1] == "compare_digest"
    assert same_secret.__globals__["hmac"] is hmac
    assert not [i for i in dis.get_instructions(same_secret) if i.opname in ("COMPARE_OP", "IS_OP")]
    assert same_secret("tpk-abc", "tpk-abc")
    assert not same_secret("tpk-abc", "tpk-abd")
    assert not same_secret("tpk-abc", "tpk-ab")

    # Every place a secret is checked calls it, and compares the secret no other way.
    for check in (Router._check_token, Broker.authenticate):
        assert "same_secret" in names_in(check), check
        assert check.__globals__["same_secret"] is same_secret
        assert equality_tests_in(check) == [], check


# 2. Isolation between episodes


@pytest.mark.settings(trainer_token=TOKEN)
def test_an_episode_key_opens_no_trainer_route(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    base = server.url
    a, b, answer_a, answer_b, turn_a, turn_b = two_parked_episodes(trainer, f"{base}/v1", background)
    before = {e.id: snapshot(base, e.id, TOKEN) for e in (a, b)}
    assert_every_route_is_listed(base, trainer_routes(b.id, turn_b.id), b.id, turn_b.id)

    in_headers = [
        bearer(a.key),
        {"x-api-key": a.key},
        {"authorization": a.key},
        {**bearer(a.key), "x-api-key": a.key},
        {**bearer(TOKEN[:-1] + "x"), "x-api-key": TOKEN},  # the token itself, but in the agents' header
    ]
    with httpx.Client(base_url=base, timeout=10) as http:
        for target, turn in ((b, turn_b), (a, turn_a)):
            for method, path, body in trainer_routes(target.id, turn.id):
                for headers in in_headers:
                    response = http.request(method, path, json=body, headers=headers)
                    assert "TRAJPROXY_TRAINER_TOKEN" in message_of(response, 401), path
                    assert target.task not in response.text
                for headers in ({}, bearer(a.key)):  # the key in the path, as agents that force their own key use it
                    response = http.request(method, f"/e/{a.key}{path}", json=body, headers=headers)
                    message_of(response, 404)
                    assert a.key not in response.text and target.task not in response.text

    assert_untouched_then_served(trainer, base, before, [(a, turn_a, answer_a), (b, turn_b, answer_b)], TOKEN)


def test_an_episode_key_opens_no_trainer_route_over_the_sandbox_socket(
    make_server: Callable[..., Any], socket_dir: str, background: Callable[..., Future[Any]]
) -> None:
    """No trainer token at all: sandboxed agents, which reach trajproxy only through its socket, still cannot."""
    sock = f"{socket_dir}/proxy.sock"
    server = make_server(socket_path=sock, no_trainer_token=True)

    def sandbox_side() -> httpx.Client:
        # No read timeout: each agent's call stays parked until the trainer answers it at the end, however long the
        # probes take; one that gave up would hang up, and its turn would leave the queue before it is pulled.
        timeout = httpx.Timeout(10, read=None)
        return httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://sandbox", timeout=timeout)

    with TrainerClient(server.url, server.token) as trainer:
        a, b, answer_a, answer_b, turn_a, turn_b = two_parked_episodes(
            trainer, "http://sandbox/v1", background, agent_http=sandbox_side
        )
        before = {e.id: snapshot(server.url, e.id) for e in (a, b)}

        with sandbox_side() as http:
            for target, turn in ((b, turn_b), (a, turn_a)):
                for method, path, body in trainer_routes(target.id, turn.id):
                    for headers in ({}, bearer(a.key), {"x-api-key": a.key}):
                        response = http.request(method, path, json=body, headers=headers)
                        assert "sandbox socket" in message_of(response, 403), path
                    response = http.request(method, f"/e/{a.key}{path}", json=body)
                    message_of(response, 404)
                    assert target.task not in response.text

        assert_untouched_then_served(trainer, server.url, before, [(a, turn_a, answer_a), (b, turn_b, answer_b)])


@pytest.mark.settings(no_trainer_token=True)  # raw snapshots of the trainer API; its door is tested above
def test_calls_land_only_in_the_keys_episode_in_every_dialect(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    base = server.url
    a = trainer.create_episode(task="A")
    b = trainer.create_episode(task="B")
    answer = background(ask, f"{base}/v1", b.key, "B's own call")
    trainer.reply(pull_one(trainer, b.id).id, "for B")
    assert answer.result(timeout=10) == "for B"
    b_before = snapshot(base, b.id)

    def chat(base_url: str, key: str) -> Callable[[str], Any]:
        return lambda text: ask(base_url, key, text)

    def responses(base_url: str, key: str) -> Callable[[str], Any]:
        return lambda text: respond(base_url, key, text).output_text

    def messages(base_url: str, key: str) -> Callable[[str], Any]:
        return lambda text: text_of(ask_claude(base_url, key, text))

    path = f"{base}/e/{a.key}"
    agents = {
        "chat, bearer": chat(f"{base}/v1", a.key),
        "responses, bearer": responses(f"{base}/v1", a.key),
        "messages, x-api-key": messages(base, a.key),
        "chat, A's key in the path, B's as bearer": chat(f"{path}/v1", b.key),
        "responses, A's key in the path, B's as bearer": responses(f"{path}/v1", b.key),
        "messages, A's key in the path, B's as x-api-key": messages(path, b.key),
    }
    for name, agent in agents.items():
        answer = background(agent, f"from A: {name}")
        turn = pull_one(trainer)  # across every episode: exactly one turn, and it is A's
        assert turn.episode_id == a.id, name
        assert f"from A: {name}" in json.dumps(turn.request), name
        trainer.reply(turn.id, f"answer to {name}")
        assert answer.result(timeout=10) == f"answer to {name}"

    assert len(trainer.trajectory(a.id).turns) == len(agents)
    assert snapshot(base, b.id) == b_before


def raw_chat(base: str, key: str, body: bytes, retry: int) -> httpx.Response:
    """A chat call sent as an SDK sends it, retry header included, with these exact bytes."""
    headers = {**bearer(key), "content-type": "application/json", "x-stainless-retry-count": str(retry)}
    return httpx.post(f"{base}/v1/chat/completions", content=body, headers=headers, timeout=20)


def content_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


@pytest.mark.settings(retry_grace_s=10)
def test_a_key_cannot_continue_or_replay_another_episodes_turns(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    base = server.url
    a = trainer.create_episode(task="A")
    b = trainer.create_episode(task="B")

    # previous_response_id naming B's response: refused, and nothing is parked for A.
    answer = background(respond, f"{base}/v1", b.key, "B's secret plan")
    trainer.reply(pull_one(trainer, b.id).id, "B's private answer")
    b_response = answer.result(timeout=10)
    with pytest.raises(openai.NotFoundError):
        respond(f"{base}/v1", a.key, "go on", previous_response_id=b_response.id)
    assert trainer.trajectory(a.id).turns == []

    # A retry of B's answered call's exact bytes does not replay B's reply: it is a new call of A's.
    answered = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "B's answered call"}]}).encode()
    answer = background(raw_chat, base, b.key, answered, 0)
    trainer.reply(pull_one(trainer, b.id).id, "only for B")
    assert content_of(answer.result(timeout=10)) == "only for B"
    replayed = background(raw_chat, base, a.key, answered, 1)
    turn = pull_one(trainer)
    assert turn.episode_id == a.id
    trainer.reply(turn.id, "for A")
    assert content_of(replayed.result(timeout=10)) == "for A"

    # A retry of B's parked call's exact bytes does not attach to B's turn: it parks a turn of A's own.
    open_call = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "B's open call"}]}).encode()
    answer_b = background(raw_chat, base, b.key, open_call, 0)
    [*_, open_b] = parked(trainer, b.id, 3)
    answer_a = background(raw_chat, base, a.key, open_call, 1)
    [*_, open_a] = parked(trainer, a.id, 2)
    assert open_a.id != open_b.id
    trainer.reply(open_b.id, "B's reply")
    trainer.reply(open_a.id, "A's reply")
    assert content_of(answer_b.result(timeout=10)) == "B's reply"
    assert content_of(answer_a.result(timeout=10)) == "A's reply"
    assert [t.status for t in trainer.trajectory(b.id).turns] == ["answered"] * 3


# 3. The trainer token on non-loopback binds


def own_address() -> str | None:
    """This machine's address on its default route, if it has one (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if ipaddress.ip_address(address).is_loopback else address


def ipv6_works() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


def bind_and_reach(which: str) -> tuple[str, str]:
    """The address to bind, and the host part of a URL that reaches it from here (not via loopback if possible)."""
    own = own_address()
    if which == "own address":
        if own is None:
            pytest.skip("this machine has no non-loopback address")
        return own, own
    if which == "::":
        if not ipv6_works():
            pytest.skip("no IPv6 on this machine")
        return "::", "[::1]"
    return "0.0.0.0", own or "127.0.0.1"


NON_LOOPBACK = ["0.0.0.0", "::", "own address"]


@pytest.mark.parametrize("which", NON_LOOPBACK)
def test_a_non_loopback_bind_opted_out_of_the_token_does_not_start(tmp_path: Path, which: str) -> None:
    host, reach = bind_and_reach(which)
    port = str(free_port())
    for how, args, env in [
        ("--no-trainer-token", ["--no-trainer-token"], {}),
        ("TRAJPROXY_NO_TRAINER_TOKEN", [], {"TRAJPROXY_NO_TRAINER_TOKEN": "1"}),
    ]:
        done = run_cli(["serve", "--host", host, "--port", port, *args], tmp_path, clean_env(**env))
        assert done.returncode != 0, (how, done.stdout, done.stderr)
        assert "without a trainer token" in done.stderr and "--no-trainer-token" in done.stderr, (how, done.stderr)
        assert host in done.stderr, (how, done.stderr)
        assert "Traceback" not in done.stderr, (how, done.stderr)
        assert not (tmp_path / "trajproxy.db").exists()
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://{reach}:{port}/health", timeout=2)


@pytest.mark.parametrize("which", NON_LOOPBACK)
@pytest.mark.timeout(3 * START_S)  # starts of the console script, each slow on a loaded machine
def test_a_non_loopback_bind_with_no_token_given_guards_the_api_with_a_generated_one(
    tmp_path: Path, which: str
) -> None:
    host, reach = bind_and_reach(which)
    for how, args, env in [
        ("no token", [], {}),
        ("an empty --trainer-token", ["--trainer-token", ""], {}),
        ("a blank TRAJPROXY_TRAINER_TOKEN", [], {"TRAJPROXY_TRAINER_TOKEN": "  "}),
    ]:
        token_file = tmp_path / how.replace(" ", "-") / "token"
        port = free_port()
        base = f"http://{reach}:{port}"
        environment = clean_env(TRAJPROXY_TRAINER_TOKEN_FILE=str(token_file), **env)
        with serving(["--host", host, "--port", str(port), *args], tmp_path, environment) as served:
            served.wait_healthy(port, reach)
            token = token_file.read_text().strip()
            assert len(token) >= 32, how
            assert request(base, "GET", "/api/episodes").status_code == 401, how
            assert request(base, "GET", "/api/episodes", headers=bearer(token)).status_code == 200, how
        assert token not in served.output(), how  # its log never holds it (nobody was at a terminal)


@pytest.mark.parametrize("which", NON_LOOPBACK)
@pytest.mark.timeout(3 * START_S)  # starts of the console script, each slow on a loaded machine
def test_a_non_loopback_bind_with_a_token_guards_the_trainer_api(tmp_path: Path, which: str) -> None:
    host, reach = bind_and_reach(which)
    port = free_port()
    base = f"http://{reach}:{port}"
    with serving(["--host", host, "--port", str(port), "--trainer-token", TOKEN], tmp_path) as served:
        served.wait_healthy(port, reach)
        created = request(base, "POST", "/api/episodes", json={"task": "t"}, headers=bearer(TOKEN))
        assert created.status_code == 201, created.text
        key = created.json()["key"]
        for headers in ({}, bearer("wrong"), bearer(TOKEN + "x"), bearer(key), {"x-api-key": TOKEN}):
            for method, path in [("GET", "/api/episodes"), ("POST", "/api/episodes"), ("GET", "/api/turns/next")]:
                response = request(base, method, path, json={} if method == "POST" else None, headers=headers)
                assert response.status_code == 401, (headers, path, response.text)
        listed = request(base, "GET", "/api/episodes", headers=bearer(TOKEN))
        assert [e["task"] for e in listed.json()["episodes"]] == ["t"]
    assert TOKEN not in served.output()


# 4. Body size and JSON nesting

LIMIT = 2000
AGENT_ROUTES = ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/messages/count_tokens"]


def post(base: str, path: str, body: bytes, headers: dict[str, str], framing: str) -> httpx.Response:
    content = chunked(body) if framing == "chunked" else body
    return request(base, "POST", path, content=content, headers={"content-type": "application/json", **headers})


@pytest.mark.settings(max_body_bytes=LIMIT, no_trainer_token=True)  # the trainer API's limits, not its door
def test_bodies_over_the_limit_are_413_on_every_route_however_framed(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    base = server.url
    episode = trainer.create_episode()
    answer = background(ask, f"{base}/v1", episode.key)
    [turn] = parked(trainer, episode.id)
    before = snapshot(base, episode.id)
    too_big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * LIMIT}]}).encode()

    carriers = [("", bearer(episode.key)), ("", {"x-api-key": episode.key}), (f"/e/{episode.key}", {})]
    for path in AGENT_ROUTES:
        for prefix, headers in carriers:
            for framing in ("content-length", "chunked"):
                response = post(base, prefix + path, too_big, headers, framing)
                assert f"{LIMIT}-byte limit" in message_of(response, 413), (path, framing)
                assert response.json()["error"]["type"] == "request_too_large"
    for method, path, _ in trainer_routes(episode.id, turn.id):
        if method == "POST":
            for framing in ("content-length", "chunked"):
                response = post(base, path, too_big, {}, framing)
                assert f"{LIMIT}-byte limit" in message_of(response, 413), (path, framing)

    # The limit is exact: a body of LIMIT bytes is served, one byte more is not.
    padding = LIMIT - len(json.dumps({"task": ""}))
    at_limit = json.dumps({"task": "y" * padding}).encode()
    assert len(at_limit) == LIMIT
    for framing in ("content-length", "chunked"):
        assert post(base, "/api/episodes", at_limit[:-2] + b'y"}', {}, framing).status_code == 413
        assert post(base, "/api/episodes", at_limit, {}, framing).status_code == 201

    assert snapshot(base, episode.id) == before
    assert len(trainer.episodes().episodes) == 3
    assert not answer.done()
    trainer.reply(turn.id, "small enough")
    assert answer.result(timeout=10) == "small enough"


@pytest.mark.settings(max_body_bytes=2 * 2**20, no_trainer_token=True)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/episodes"])
def test_a_refused_body_still_arriving_is_read_so_that_its_413_reaches_the_client(
    server: Any, trainer: TrainerClient, path: str
) -> None:
    """A body declared over the limit (2 MiB here) by less than a MiB is read and dropped, all of it, before the
    server answers 413 and closes: closed under a body still arriving, the connection was reset, and the client, still
    sending, never read its 413 (test_trainer_api failed so once in CI, a trainer route's refusal closing it)."""
    content = "x" * (2 * 2**20 + 900_000)
    body = json.dumps({"model": MODEL, "task": "t", "messages": [{"role": "user", "content": content}]}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\nconnection: close\r\n"
    head += f"authorization: Bearer {trainer.create_episode().key}\r\ncontent-length: {len(body)}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(head.encode() + body)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert f"{2 * 2**20}-byte limit".encode() in answer


def nested(depth: int) -> str:
    """A JSON value `depth` arrays deep, built as text (json.dumps itself would give up long before 100,000)."""
    return "[" * depth + "]" * depth


TOO_DEEP = [MAX_JSON_DEPTH + 1, 300, 600, 5_000, 100_000]


def deep_trainer_bodies(episode_id: str, turn_id: str, value: str) -> list[tuple[str, str]]:
    """A body for each trainer route that takes one, `value` in a field it keeps or passes on."""
    message = f'{{"content": "x", "extra": {value}}}'
    return [
        ("/api/episodes", f'{{"task": "t", "metadata": {{"deep": {value}}}}}'),
        (f"/api/episodes/{episode_id}/rewards", f'{{"value": 1, "info": {{"deep": {value}}}}}'),
        (f"/api/episodes/{episode_id}/finish", f'{{"status": "failed", "reason": "r", "extra": {value}}}'),
        (f"/api/episodes/{episode_id}/step?wait=0", f'{{"turn_id": "{turn_id}", "message": {message}}}'),
        (f"/api/turns/{turn_id}/reply", f'{{"message": {message}}}'),
        ("/api/turns/replies", f'{{"replies": [{{"turn_id": "{turn_id}", "message": {message}}}]}}'),
        (f"/api/turns/{turn_id}/forward", f'{{"model": "openai/x", "options": {{"deep": {value}}}}}'),
        ("/api/pause", f'{{"mode": "reject", "extra": {value}}}'),
    ]


@pytest.mark.settings(no_trainer_token=True)  # the trainer API's limits, not its door (tested above)
def test_deeply_nested_json_is_refused_clearly_on_trainer_routes(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    base = server.url
    episode = trainer.create_episode()
    answer = background(ask, f"{base}/v1", episode.key)
    [turn] = parked(trainer, episode.id)
    before = snapshot(base, episode.id)

    for depth in TOO_DEEP:
        for path, body in deep_trainer_bodies(episode.id, turn.id, nested(depth)):
            response = post(base, path, body.encode(), {}, "content-length")
            assert response.status_code in (400, 422), (depth, path, response.text)
            assert re.search("deep|nest", message_of(response, response.status_code)), (depth, path, response.text)
            assert response.json()["error"]["type"] == "invalid_request_error"
    assert request(base, "GET", "/health").status_code == 200

    # Ordinary nesting (a deep JSON schema is some 20 levels) is kept as sent.
    metadata = json.loads('{"deep": ' + nested(32) + "}")
    kept = trainer.create_episode(metadata=metadata)
    assert trainer.episode(kept.id).metadata == metadata

    assert snapshot(base, episode.id) == before
    assert len(trainer.episodes().episodes) == 2
    assert request(base, "GET", "/health").json()["paused"] is None
    trainer.reply(turn.id, "still served")
    assert answer.result(timeout=10) == "still served"


def deep_agent_bodies(value: str) -> list[tuple[str, str]]:
    """A body for each agent route, `value` in a tool's schema, where real agents nest the deepest."""
    user = '[{"role": "user", "content": "hi"}]'
    return [
        (
            "/v1/chat/completions",
            f'{{"model": "m", "messages": {user}, "tools": [{{"type": "function", "function": '
            f'{{"name": "f", "parameters": {{"deep": {value}}}}}}}]}}',
        ),
        (
            "/v1/messages",
            f'{{"model": "m", "max_tokens": 5, "messages": {user}, '
            f'"tools": [{{"name": "f", "input_schema": {{"deep": {value}}}}}]}}',
        ),
        (
            "/v1/responses",
            f'{{"model": "m", "input": "hi", "tools": [{{"type": "function", "name": "f", '
            f'"parameters": {{"deep": {value}}}}}]}}',
        ),
        (
            "/v1/messages/count_tokens",
            f'{{"model": "m", "messages": {user}, "tools": [{{"name": "f", "input_schema": {{"deep": {value}}}}}]}}',
        ),
    ]


def test_deeply_nested_json_is_a_clear_400_on_agent_routes(server: Any, trainer: TrainerClient) -> None:
    base = server.url
    episode = trainer.create_episode()
    for depth in TOO_DEEP[1:]:  # 129 levels can still be stored: without a limit at the edge, that call is parked
        for path, body in deep_agent_bodies(nested(depth)):
            response = post(base, path, body.encode(), bearer(episode.key), "content-length")
            assert re.search("deep|depth", message_of(response, 400)), (depth, path, response.text)
    assert request(base, "GET", "/health").status_code == 200
    assert trainer.next_turns(wait_s=0) == []
    assert trainer.trajectory(episode.id).turns == []


# 5. Logs


def drive_every_path(
    base: str, token: str, impostors: list[str], upstream: dict[str, Any], background: Callable[..., Future[Any]]
) -> list[str]:
    """Served calls, refusals, bad keys and tokens, finished episodes, timeouts, expired leases, hang-ups, forwards
    and bad bodies, all against the server at `base`; returns the keys of the episodes it made."""
    trainer = TrainerClient(base, token=token)
    served, closed = (trainer.create_episode(task=t) for t in ("served", "closed"))
    late = trainer.create_episode(task="late", turn_timeout_s=2)  # the rest have the server's, long on a busy machine
    forwarded = trainer.create_episode(task="forwarded", turn_timeout_s=60)  # litellm takes seconds to load

    # Served, in every dialect and with every key carrier, streamed or not.
    def stream(text: str) -> str:
        with chat_agent(f"{base}/v1", served.key) as agent:
            chunks = agent.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": text}], stream=True
            )
            return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)

    with anthropic.Anthropic(base_url=f"{base}/e/{served.key}", api_key="ignored", max_retries=0) as claude:
        for call in (
            lambda: ask(f"{base}/v1", served.key),
            lambda: stream("streamed"),
            lambda: respond(f"{base}/e/{served.key}/v1", "ignored", "x"),
            lambda: claude.messages.create(model="c", max_tokens=5, messages=[{"role": "user", "content": "x"}]),
        ):
            answer = background(call)
            trainer.reply(pull_one(trainer, served.id).id, "ok")
            answer.result(timeout=10)
        assert claude.messages.count_tokens(model="c", messages=[{"role": "user", "content": "x"}]).input_tokens > 0
    trainer.add_reward(served.id, 1.0, info={"k": "v"})

    # Refused: bad, missing and misplaced keys and tokens, keys in paths that lead nowhere.
    agent_call = {"model": MODEL, "messages": HELLO}
    for secret in [*impostors, token]:  # the trainer token is no episode key either
        assert request(base, "POST", "/v1/chat/completions", json=agent_call, headers=bearer(secret)).status_code == 401
        assert request(base, "POST", "/v1/messages", json=agent_call, headers={"x-api-key": secret}).status_code == 401
        assert request(base, "POST", f"/e/{secret}/v1/chat/completions", json=agent_call).status_code == 401
    for headers in [*(bearer(secret) for secret in impostors), {"x-api-key": token}, bearer(served.key)]:
        assert request(base, "GET", "/api/episodes", headers=headers).status_code == 401
        assert request(base, "POST", "/api/turns/replies", json={}, headers=headers).status_code == 401
    assert request(base, "POST", "/v1/chat/completions", json=agent_call).status_code == 401
    assert request(base, "GET", f"/e/{served.key}/nowhere").status_code == 404
    assert request(base, "GET", f"/e/{served.key}/v1/chat/completions").status_code == 405
    assert request(base, "GET", f"/e/{served.key}/api/episodes", headers=bearer(token)).status_code == 404

    # Bad bodies with a good key, and a previous response that does not exist.
    agent = {**bearer(served.key), "content-type": "application/json"}
    assert request(base, "POST", "/v1/chat/completions", content=b"{nope", headers=agent).status_code == 400
    too_big = b'{"messages": "' + b"x" * 100_000 + b'"}'
    assert request(base, "POST", "/v1/chat/completions", content=too_big, headers=agent).status_code == 413
    assert (
        request(base, "POST", "/v1/chat/completions", content=chunked(too_big, 10_000), headers=agent).status_code
        == 413
    )
    request(base, "POST", "/v1/chat/completions", content=deep_agent_bodies(nested(300))[0][1], headers=agent)
    deep = deep_trainer_bodies(served.id, "tu_none", nested(300))[1][1]
    assert (
        request(base, "POST", f"/api/episodes/{served.id}/rewards", content=deep, headers=json_as(token)).status_code
        == 400
    )
    with pytest.raises(openai.NotFoundError):
        respond(f"{base}/v1", served.key, "x", previous_response_id="resp_none")

    # Paused: new calls rejected with 429.
    trainer.pause("reject", retry_after_s=1)
    assert request(base, "POST", "/v1/chat/completions", json=agent_call, headers=bearer(served.key)).status_code == 429
    trainer.resume()

    # A finished episode: its parked call ends, its key is refused, its turn cannot be answered.
    answer = background(request, base, "POST", "/v1/chat/completions", json=agent_call, headers=bearer(closed.key))
    turn = pull_one(trainer, closed.id)
    trainer.finish(closed.id, "cancelled", reason="stopped")
    assert answer.result(timeout=10).status_code in (409, 410)
    assert request(base, "POST", "/v1/messages", json=agent_call, headers={"x-api-key": closed.key}).status_code == 410
    with pytest.raises(TrajproxyAPIError):
        trainer.reply(turn.id, "too late")

    # Timeouts: a lease that expires (logged), then the turn's own timeout (504), and a client that hangs up.
    answer = background(request, base, "POST", "/v1/chat/completions", json=agent_call, headers=bearer(late.key))
    pull_one(trainer, late.id, lease_s=0.2)
    assert answer.result(timeout=20).status_code == 504
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/e/{late.key}/v1/chat/completions", json=agent_call, timeout=0.5)

    # Forwarded to a model, which answers once and fails once.
    answer = background(ask, f"{base}/v1", forwarded.key, "hello")
    trainer.forward(pull_one(trainer, forwarded.id).id, "openai/upstream", options=upstream)
    assert str(answer.result(timeout=20)).startswith("upstream saw")
    answer = background(ask, f"{base}/v1", forwarded.key, "please fail")
    turn = pull_one(trainer, forwarded.id)
    with pytest.raises(TrajproxyAPIError):
        trainer.forward(turn.id, "openai/upstream", options=upstream)
    trainer.reply(turn.id, error={"status": 500, "message": "the model failed"})
    with pytest.raises(openai.InternalServerError):
        answer.result(timeout=20)
    trainer.close()
    return [served.key, closed.key, late.key, forwarded.key]


@pytest.mark.timeout(3 * START_S)  # starts of the console script, each slow on a loaded machine
def test_no_key_or_token_reaches_the_logs(
    database_url: str, tmp_path: Path, fake_model: Any, background: Callable[..., Future[Any]]
) -> None:
    token = "trainer-" + secrets.token_urlsafe(24)
    impostors = ["tpk-" + secrets.token_urlsafe(32), token[:-1], "sk-" + secrets.token_hex(20)]
    port = free_port()
    args = [
        *("--port", str(port), "--database-url", database_url, "--log-level", "debug", "--trainer-token", token),
        *("--turn-timeout-s", "60", "--retry-grace-s", "0.2", "--max-body-bytes", "100000"),
    ]
    with serving(args, tmp_path) as served:
        served.wait_healthy(port)
        used = drive_every_path(f"http://127.0.0.1:{port}", token, impostors, fake_model.options(), background)
        served.stop()
    output = served.output()

    assert "serving on" in output and "Application shutdown complete" in output
    assert " DEBUG " in output  # the level took effect (the forwards log their requests at it)
    assert re.search(r"lease on turn tu_\w+ expired", output), output[-3000:]  # what was done is in the log
    for secret in [*used, token, *impostors]:
        body = secret.removeprefix("tpk-")
        for fragment in {secret, body, body[:12], body[-12:]}:
            assert fragment not in output, f"{fragment!r} of a secret is in the log"


# 6. Sandbox hardening (Docker)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


STATUS = "grep -E '^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|Seccomp):' /proc/{pid}/status"
# Memory, memory plus swap, pids, "quota period", from cgroup v2 or v1 files.
LIMITS = """cd /sys/fs/cgroup
if [ -f memory.max ]; then cat memory.max; echo $(( $(cat memory.max) + $(cat memory.swap.max) )); cat pids.max cpu.max
else cat memory/memory.limit_in_bytes memory/memory.memsw.limit_in_bytes pids/pids.max
echo "$(cat cpu/cpu.cfs_quota_us) $(cat cpu/cpu.cfs_period_us)"
fi"""
POWERS = """echo secret > /tmp/own; chmod 000 /tmp/own
cat /tmp/own >/dev/null 2>&1 && echo "read a mode-000 file: yes" || echo "read a mode-000 file: no"
chown 1:1 /tmp/own 2>/dev/null && echo "chown: yes" || echo "chown: no"
mkdir -p /tmp/m; mount -t tmpfs none /tmp/m 2>/dev/null && echo "mount: yes" || echo "mount: no"
python3 -c "import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)" 2>/dev/null \
  && echo "raw socket: yes" || echo "raw socket: no"
(echo box > /proc/sys/kernel/hostname) 2>/dev/null && echo "write /proc/sys: yes" || echo "write /proc/sys: no"
"""


def assert_unprivileged(status: str) -> None:
    fields = dict(line.split(":\t") for line in status.strip().splitlines())
    for capabilities in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert fields[capabilities] == "0000000000000000", (capabilities, status)
    assert fields["NoNewPrivs"] == "1", status
    assert fields["Seccomp"] == "2", status  # the engine's default syscall filter is in force


def test_the_agent_and_its_gate_run_without_privileges(sandboxes: DockerSandboxes, engine: Any) -> None:
    limits = Limits(cpus=0.5, memory_bytes=256 * 1024**2, pids=64)

    async def scenario() -> None:
        box = await sandboxes.start(SandboxSpec(IMAGE, limits=limits))
        try:
            # The agent: as an agent's commands run (exec), no capability, no way to gain one, within its limits.
            assert_unprivileged((await box.exec(STATUS.format(pid="self"), timeout_s=10)).output)
            memory, memory_and_swap, pids, cpu = (await box.exec(LIMITS, timeout_s=10)).output.split("\n")[:4]
            assert int(memory) == int(memory_and_swap) == 256 * 1024**2  # no swap beyond its memory
            assert int(pids) == 64
            quota, period = cpu.split()
            assert int(quota) / int(period) == pytest.approx(0.5)
            # Root in name only: nothing that needs a capability works.
            powers = await box.exec(POWERS, timeout_s=10)
            assert [line for line in powers.output.splitlines() if ": " in line] == [
                "read a mode-000 file: no",
                "chown: no",
                "mount: no",
                "raw socket: no",
                "write /proc/sys: no",
            ], powers.output
            mounts = (await box.exec("cat /proc/self/mountinfo", timeout_s=10)).output
            assert "docker.sock" not in mounts and "/run/trajproxy" not in mounts

            agent = engine.containers.get(box.id)
            host = agent.attrs["HostConfig"]
            assert host["Privileged"] is False
            assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
            assert host["SecurityOpt"] == ["no-new-privileges"]
            assert not host["Binds"] and not agent.attrs["Mounts"]
            mode, _, gate_id = host["NetworkMode"].partition(":")
            assert mode == "container"

            # The gate: no network of its own, the proxy's socket its only mount, unprivileged, within its limits.
            gate = engine.containers.get(gate_id)
            assert gate.attrs["HostConfig"]["NetworkMode"] == "none"
            assert gate.attrs["HostConfig"]["Privileged"] is False
            assert [m["Destination"] for m in gate.attrs["Mounts"]] == ["/run/trajproxy"]
            exit_code, status = gate.exec_run(["sh", "-c", STATUS.format(pid=1)])
            assert exit_code == 0
            assert_unprivileged(status.decode())
            exit_code, gate_limits = gate.exec_run(["sh", "-c", LIMITS])
            memory, memory_and_swap, pids, _ = gate_limits.decode().split("\n")[:4]
            assert int(memory) == 64 * 1024**2
            assert int(pids) == 32
            exit_code, interfaces = gate.exec_run(["cat", "/proc/net/dev"])
            assert [line.split(":")[0].strip() for line in interfaces.decode().splitlines()[2:]] == ["lo"]
        finally:
            await box.stop()

    run(scenario())


CONNECT = """import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3).close()
    print("connected")
except OSError as e:
    print("refused", e)"""
LISTEN = "import socket, time; s = socket.create_server(('0.0.0.0', {port})); time.sleep(120)"


def test_one_sandbox_cannot_reach_another(sandboxes: DockerSandboxes) -> None:
    """Each sandbox has a loopback of its own: a service in one is out of reach from every other."""
    port = 9753

    async def scenario() -> None:
        one = await sandboxes.start(SandboxSpec(IMAGE))
        other = await sandboxes.start(SandboxSpec(IMAGE))
        try:
            started = await other.exec(f'nohup python3 -c "{LISTEN.format(port=port)}" >/dev/null 2>&1 &', timeout_s=10)
            assert started.ok, started.output
            probe = f"python3 -c '{CONNECT}' {port}"
            deadline = time.monotonic() + 20
            while not (inside := await other.exec(probe, timeout_s=10)).output.startswith("connected"):
                assert time.monotonic() < deadline, inside.output  # control: the service is up, where it runs
                await asyncio.sleep(0.2)
            outside = await one.exec(probe, timeout_s=10)
            assert outside.output.startswith("refused"), outside.output
        finally:
            await one.stop()
            await other.stop()

    run(scenario())
