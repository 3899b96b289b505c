"""Faults on real processes: the proxy killed -9 and restarted, a trainer killed -9 or frozen, and agents and
trainers hanging up mid-call. Every wait is bounded; what is checked is the record in the database."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy
from fastapi import FastAPI, Request

from proxy.client import TrainerClient, TrajproxyAPIError
from proxy.storage.content import turns as turn_table
from proxy.storage.engines import engine_url
from proxy.storage.stored_turns import turns_of
from testkit.tasks import ROOT
from tests.conftest import LiveServer, serve_app
from tests.test_cli import EXIT_S, clean_env, free_port, serving

WAIT_S = 60.0  # bound on any one thing a test waits for (CI runs three test files at once on two cores)
LITELLM_LOAD_S = 120.0  # a server's first call to a model loads litellm: seconds, over a minute on a busy machine
# An SDK's default 2 retries span about 1.5 s; a restart of the proxy on a busy machine can take longer, so the
# agents here retry 5 times (their last attempt about 15 s after the crash), as a deployment that restarts would.
RESTART_RETRIES = 5

pytestmark = pytest.mark.timeout(90)
# Faults of the processes around the proxy need no second database; a restart of the proxy runs on both.
sqlite_only = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def wait_until(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def health(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/health", timeout=5).json())


def ask(client: openai.OpenAI, text: str) -> str:
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
    return reply.choices[0].message.content or ""


@pytest.fixture
def sdk_agent() -> Iterator[Callable[..., openai.OpenAI]]:
    """An agent's SDK client for an episode, closed when the test ends (left to the garbage collector, its socket's
    ResourceWarning would fail whichever test happens to be running then)."""
    with contextlib.ExitStack() as clients:

        def agent(episode: Any, retries: int = 0) -> openai.OpenAI:
            made = openai.OpenAI(
                base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=retries, timeout=60
            )
            return clients.enter_context(made)

        yield agent


def asked(turn: Any) -> str:
    return str(turn.request["messages"][-1]["content"])


def pull(trainer: TrainerClient, n: int, **query: Any) -> list[Any]:
    """Pull exactly `n` turns, waiting at most WAIT_S for them."""
    turns: list[Any] = []
    deadline = time.monotonic() + WAIT_S
    while len(turns) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"only {len(turns)} of {n} turns came within {WAIT_S:g} s")
        turns += trainer.next_turns(max=n - len(turns), wait_s=1, **query)
    assert len(turns) == n
    return turns


def answer(trainer: TrainerClient, turns: list[Any]) -> None:
    for turn in turns:
        trainer.reply(turn.id, f"re: {asked(turn)}", lease_id=turn.lease_id)


def chat_body(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


def raw_call(url: str, key: str, text: str, retry: int, timeout_s: float) -> httpx.Response:
    """A call as an SDK sends it, attempt number included."""
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    headers["x-stainless-retry-count"] = str(retry)
    return httpx.post(f"{url}/v1/chat/completions", content=chat_body(text), headers=headers, timeout=timeout_s)


def held_call(port: int, key: str, text: str) -> socket.socket:
    """A first attempt of a call (the same bytes as `raw_call`'s) on a bare socket: its agent hangs up when the
    socket is closed."""
    body = chat_body(text)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\nx-stainless-retry-count: 0\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.sendall(head.encode() + body)
    return sock


def recorded(database_url: str) -> list[dict[str, Any]]:
    """Every turn in the database, read directly: its episode, seq, status, deliveries, call text and reply text."""
    engine = sqlalchemy.create_engine(engine_url(database_url))
    try:
        with engine.connect() as conn:
            rows = conn.execute(sqlalchemy.select(turn_table).order_by(turn_table.c.episode_id, turn_table.c.seq)).all()
            wires = [
                bytes(turn.wire) for turn in turns_of(conn, rows)
            ]  # each call's body, put together from its pieces
    finally:
        engine.dispose()
    turns = []
    for row, wire in zip(rows, wires, strict=True):
        reply = json.loads(row.reply) if isinstance(row.reply, str) else row.reply
        turns.append(
            {
                "id": row.id,
                "episode_id": row.episode_id,
                "seq": row.seq,
                "status": row.status,
                "deliveries": row.deliveries,
                "reason": row.reason,
                "text": json.loads(wire)["messages"][-1]["content"],
                "reply": reply["message"]["content"] if reply and reply.get("message") else None,
            }
        )
    return turns


class Actors:
    """Agents and trainers running as processes of their own (tests/actors.py), killed when the test ends."""

    def __init__(self) -> None:
        self._running: list[subprocess.Popen[str]] = []
        self._reader = ThreadPoolExecutor(max_workers=8)

    def start(self, *args: str, token: str | None = None) -> subprocess.Popen[str]:
        """Start an actor; a trainer actor sends `token` (else the test run's token file's)."""
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.actors", *args],
            cwd=ROOT,
            env=clean_env(**({"TRAJPROXY_TRAINER_TOKEN": token} if token else {})),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._running.append(process)
        return process

    def said(self, process: subprocess.Popen[str], timeout_s: float = WAIT_S) -> dict[str, Any]:
        """The next line the process prints, as JSON; fails if none comes within `timeout_s`."""
        assert process.stdout is not None
        line = self._reader.submit(process.stdout.readline).result(timeout=timeout_s)
        if not line:
            raise AssertionError(f"the process ended (exit {process.wait(EXIT_S)}) before saying anything more")
        return dict(json.loads(line))

    def tell(self, process: subprocess.Popen[str], line: str) -> None:
        assert process.stdin is not None
        process.stdin.write(line + "\n")
        process.stdin.flush()

    @staticmethod
    def kill(process: subprocess.Popen[str]) -> None:
        """kill -9, and wait for it to be gone."""
        process.kill()
        process.wait(EXIT_S)

    def close(self) -> None:
        for process in self._running:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)  # a frozen process cannot die until it runs again
                self.kill(process)
        self._reader.shutdown(wait=True, cancel_futures=True)  # each read ends: its process is gone
        for process in self._running:
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    pipe.close()


@pytest.fixture
def actors() -> Iterator[Actors]:
    team = Actors()
    yield team
    team.close()


def serve_args(port: int, database_url: str, retry_grace_s: float) -> list[str]:
    return [
        "--port",
        str(port),
        "--database-url",
        database_url,
        "--retry-grace-s",
        str(retry_grace_s),
        "--lease-s",
        "60",
        "--log-level",
        "warning",
    ]


def restart_env(restart_grace_s: float) -> dict[str, str]:
    """The server's environment with its restart grace set (how long a turn taken back waits for its agent)."""
    return clean_env(TRAJPROXY_RESTART_GRACE_S=str(restart_grace_s))


def kill_server(served: Any) -> None:
    served.process.kill()
    served.process.wait(EXIT_S)


# The proxy killed -9 and started again on the same database and port


def test_a_proxy_killed_mid_turn_comes_back_with_every_turn(
    database_url: str, tmp_path: Path, background: Any, actors: Actors, sdk_agent: Callable[..., openai.OpenAI]
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = serve_args(port, database_url, retry_grace_s=60)
    with serving(args, tmp_path) as first, TrainerClient(url) as trainer:
        first.wait_healthy(port)
        episodes = [trainer.create_episode(task=f"agent {i}") for i in range(4)]
        frozen_episode, hung_up_episode = trainer.create_episode(), trainer.create_episode()
        agents = [sdk_agent(episode, retries=RESTART_RETRIES) for episode in episodes]

        # First calls, answered before the crash.
        first_calls = [background(ask, agent, f"{e.id} 1") for agent, e in zip(agents, episodes, strict=True)]
        answer(trainer, pull(trainer, 4))
        assert [call.result(timeout=WAIT_S) for call in first_calls] == [f"re: {e.id} 1" for e in episodes]

        # An agent that hung up on two calls at once while they were leased; their replies, recorded just before
        # the crash, never reached it.
        hanging_up = [held_call(port, hung_up_episode.key, f"hung up {n}") for n in (1, 2)]
        hung_up = sorted(pull(trainer, 2, episode=hung_up_episode.id), key=asked)
        for sock in hanging_up:
            sock.close()
        for turn in hung_up[::-1]:
            trainer.reply(turn.id, f"recorded for {asked(turn)}", lease_id=turn.lease_id)

        # An agent process whose turn is leased, frozen until the trainer has answered after the restart.
        frozen = actors.start("agent", url, frozen_episode.key, "frozen 1", "--retries", str(RESTART_RETRIES))
        assert actors.said(frozen) == {"calling": "frozen 1"}
        [frozen_turn] = pull(trainer, 1, episode=frozen_episode.id)
        frozen.send_signal(signal.SIGSTOP)

        # Second calls, open at the crash: two leased by the trainer, two parked.
        second_calls = [background(ask, agent, f"{e.id} 2") for agent, e in zip(agents, episodes, strict=True)]
        leased = [pull(trainer, 1, episode=episode.id)[0] for episode in episodes[:2]]
        wait_until(lambda: health(url)["ready_turns"] == 2)
        parked = [trainer.trajectory(episode.id).turns[-1] for episode in episodes[2:]]
        assert [(turn.status, turn.seq) for turn in parked] == [("parked", 1), ("parked", 1)]

        kill_server(first)

    with serving(args, tmp_path) as second, TrainerClient(url) as trainer:
        second.wait_healthy(port)
        # Leased before the crash: the reply lands under the old lease, and with none named.
        trainer.reply(frozen_turn.id, "re: frozen 1", lease_id=frozen_turn.lease_id)  # before its agent is back
        trainer.reply(leased[0].id, f"re: {asked(leased[0])}", lease_id=leased[0].lease_id)
        trainer.reply(leased[1].id, f"re: {asked(leased[1])}")
        # Parked before the crash: back in the queue as the same turns once their agents' retries reattach.
        back = sorted(pull(trainer, 2), key=lambda turn: turn.seq)
        assert sorted(turn.id for turn in back) == sorted(turn.id for turn in parked)
        assert [turn.deliveries for turn in back] == [1, 1]
        answer(trainer, back)
        assert [call.result(timeout=WAIT_S) for call in second_calls] == [f"re: {e.id} 2" for e in episodes]

        frozen.send_signal(signal.SIGCONT)  # its SDK finds the connection dead and retries: the recorded reply
        assert actors.said(frozen) == {"content": "re: frozen 1"}
        for n in (1, 2):
            retried = raw_call(url, hung_up_episode.key, f"hung up {n}", retry=1, timeout_s=WAIT_S)
            assert retried.json()["choices"][0]["message"]["content"] == f"recorded for hung up {n}"

        # New calls after the restart carry on each episode's sequence.
        third_calls = [background(ask, agent, f"{e.id} 3") for agent, e in zip(agents, episodes, strict=True)]
        answer(trainer, pull(trainer, 4))
        assert [call.result(timeout=WAIT_S) for call in third_calls] == [f"re: {e.id} 3" for e in episodes]

    turns = recorded(database_url)
    made = [f"{e.id} {n}" for e in episodes for n in (1, 2, 3)] + ["frozen 1", "hung up 1", "hung up 2"]
    assert sorted(turn["text"] for turn in turns) == sorted(made)  # one turn per call: none lost, none doubled
    assert {turn["status"] for turn in turns} == {"answered"}
    for turn in turns:
        expected = f"recorded for {turn['text']}" if turn["text"].startswith("hung up") else f"re: {turn['text']}"
        assert turn["reply"] == expected
    for episode in episodes:
        mine = [turn for turn in turns if turn["episode_id"] == episode.id]
        assert [(turn["seq"], turn["text"]) for turn in mine] == [(n - 1, f"{episode.id} {n}") for n in (1, 2, 3)]
    # A lease lives in memory (it costs no write): after the crash a delivery is known again only from a reply
    # naming its lease.
    assert {turn["id"]: turn["deliveries"] for turn in turns if turn["id"] in {t.id for t in leased}} == {
        leased[0].id: 1,
        leased[1].id: 0,
    }


def test_turns_whose_agents_do_not_come_back_after_a_restart_are_abandoned(
    database_url: str, tmp_path: Path, background: Any
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args, env = serve_args(port, database_url, retry_grace_s=1), restart_env(1)
    with serving(args, tmp_path, env) as first, TrainerClient(url) as trainer:
        first.wait_healthy(port)
        parked_episode, leased_episode = trainer.create_episode(), trainer.create_episode()
        calls = [background(raw_call, url, e.key, "gone", 0, WAIT_S) for e in (parked_episode, leased_episode)]
        [leased] = pull(trainer, 1, episode=leased_episode.id)
        wait_until(lambda: health(url)["open_turns"] == 2)
        kill_server(first)
        for call in calls:  # these agents do not retry
            assert isinstance(call.exception(timeout=WAIT_S), httpx.TransportError)

    with serving(args, tmp_path, env) as second, TrainerClient(url) as trainer:
        second.wait_healthy(port)
        assert trainer.next_turns(max=8, wait_s=3) == []  # no agent is waiting on them: no trainer gets them
        wait_until(lambda: {turn["status"] for turn in recorded(database_url)} == {"abandoned"})
        with pytest.raises(TrajproxyAPIError) as late:
            trainer.reply(leased.id, "too late", lease_id=leased.lease_id)
        assert late.value.status == 409
        assert "abandoned" in late.value.message
        assert health(url)["open_turns"] == 0

    turns = {turn["episode_id"]: turn for turn in recorded(database_url)}
    assert len(turns) == 2
    # The lease lived in memory (leases cost no write) and died with the process: no delivery is recorded.
    assert [turns[e.id]["deliveries"] for e in (parked_episode, leased_episode)] == [0, 0]
    assert all("restart" in turn["reason"] for turn in turns.values())


def test_a_turn_taken_back_waits_the_restart_grace_for_its_agent_not_the_retry_grace(
    database_url: str, tmp_path: Path, background: Any
) -> None:
    # The restart grace is far longer than a start-up, a witness's retry grace and a retry take on a busy machine;
    # which grace a turn waited is told by events (a witness abandoned, a turn still open), never by a clock.
    retry_grace_s, restart_grace_s = 0.5, 12.0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args, env = serve_args(port, database_url, retry_grace_s=retry_grace_s), restart_env(restart_grace_s)
    with serving(args, tmp_path, env) as first, TrainerClient(url) as trainer:
        first.wait_healthy(port)
        back_soon, back_late = trainer.create_episode(), trainer.create_episode()
        calls = [held_call(port, episode.key, "backing off") for episode in (back_soon, back_late)]
        wait_until(lambda: health(url)["ready_turns"] == 2)
        taken = {episode.id: trainer.trajectory(episode.id).turns[0].id for episode in (back_soon, back_late)}
        kill_server(first)
        for sock in calls:
            sock.close()

    with serving(args, tmp_path, env) as second, TrainerClient(url) as trainer:
        second.wait_healthy(port)
        # A witness: a call made after the restart whose agent hangs up waits the retry grace only. Once it is
        # abandoned, the retry grace has passed for every turn taken back (at start-up, before the witness came).
        witness = trainer.create_episode()
        hung_up = held_call(port, witness.key, "hanging up")
        wait_until(lambda: len(trainer.trajectory(witness.id).turns) == 1)
        hung_up.close()
        wait_until(lambda: trainer.trajectory(witness.id).turns[0].status == "abandoned")
        assert health(url)["open_turns"] == 2  # both turns taken back still wait for their agents
        retried = background(raw_call, url, back_soon.key, "backing off", 3, WAIT_S)  # an SDK in its backoff
        [turn] = pull(trainer, 1)
        assert turn.id == taken[back_soon.id]  # the retry joined the turn taken back: one turn, not two
        answer(trainer, [turn])
        assert retried.result(timeout=WAIT_S).json()["choices"][0]["message"]["content"] == "re: backing off"

        # The other agent comes back after the restart grace: its turn was abandoned; its call is a new turn.
        wait_until(lambda: trainer.turn(taken[back_late.id]).status == "abandoned", restart_grace_s + WAIT_S)
        retried = background(raw_call, url, back_late.key, "backing off", 4, WAIT_S)
        [turn] = pull(trainer, 1)
        assert turn.id != taken[back_late.id]
        answer(trainer, [turn])
        assert retried.result(timeout=WAIT_S).json()["choices"][0]["message"]["content"] == "re: backing off"

    turns = recorded(database_url)
    assert [(t["episode_id"], t["seq"], t["status"]) for t in turns] == sorted(
        [
            (back_soon.id, 0, "answered"),
            (back_late.id, 0, "abandoned"),
            (back_late.id, 1, "answered"),
            (witness.id, 0, "abandoned"),
        ]
    )
    reasons = {t["episode_id"]: t["reason"] for t in turns if t["status"] == "abandoned"}
    assert "restart" in reasons[back_late.id] and "disconnected" in reasons[witness.id], reasons


def test_an_episode_carries_on_each_of_its_conversations_after_a_restart(
    database_url: str, tmp_path: Path, background: Any, sdk_agent: Callable[..., openai.OpenAI]
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = serve_args(port, database_url, retry_grace_s=5)
    system, sub_agent = "you are an agent", "you are a search sub-agent"
    history = {system: [{"role": "system", "content": system}, {"role": "user", "content": "fix the bug"}]}
    history[sub_agent] = [{"role": "system", "content": sub_agent}, {"role": "user", "content": "find foo"}]

    def converse(agent: openai.OpenAI, trainer: TrainerClient, who: str) -> None:
        """One call of a conversation, answered; the conversation then goes on with the reply and a next step."""
        messages = history[who]
        pending = background(agent.chat.completions.create, model="m", messages=messages)
        [turn] = pull(trainer, 1)
        trainer.reply(turn.id, f"step {turn.seq}")
        reply = pending.result(timeout=WAIT_S).choices[0].message.model_dump(exclude_none=True)
        messages += [reply, {"role": "user", "content": "go on"}]

    with serving(args, tmp_path) as first, TrainerClient(url) as trainer:
        first.wait_healthy(port)
        episode = trainer.create_episode()
        for who in (system, sub_agent, system):
            converse(sdk_agent(episode), trainer, who)
        kill_server(first)

    with serving(args, tmp_path) as second, TrainerClient(url) as trainer:
        second.wait_healthy(port)
        for who in (system, sub_agent):  # each conversation picks up where it was
            converse(sdk_agent(episode), trainer, who)
        history["compacted"] = [{"role": "system", "content": system}, {"role": "user", "content": "a summary"}]
        converse(sdk_agent(episode), trainer, "compacted")  # and a new one opens a new branch
        turns = trainer.trajectory(episode.id).turns

    assert [(t.seq, t.branch) for t in turns] == [(0, 0), (1, 1), (2, 0), (3, 0), (4, 1), (5, 2)]
    ids = [t.id for t in turns]
    assert [t.parent_id for t in turns] == [None, None, ids[0], ids[2], ids[1], None]


@dataclass
class SlowModel:
    """An upstream model (a fake: real ones are external and expensive) that keeps calls waiting until
    `answering` is set, then answers each with how many messages it saw."""

    url: str = ""
    answering: threading.Event = field(default_factory=threading.Event)
    calls: int = 0


@pytest.fixture
def slow_model() -> Iterator[SlowModel]:
    model = SlowModel()
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Any:
        body = await request.json()
        model.calls += 1
        await asyncio.to_thread(model.answering.wait, WAIT_S)
        content = f"upstream saw {len(body['messages'])} messages"
        return {
            "id": "chatcmpl-slow",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        }

    running = serve_app(app)
    model.url = running.live.url
    yield model
    model.answering.set()
    running.stop()


@sqlite_only
def test_a_call_a_model_was_answering_at_the_crash_goes_to_the_model_again(
    database_url: str, tmp_path: Path, background: Any, slow_model: SlowModel, sdk_agent: Callable[..., openai.OpenAI]
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = serve_args(port, database_url, retry_grace_s=60)
    env = clean_env(OPENAI_API_KEY="sk-fake")  # the upstream's credentials live in trajproxy's environment
    with serving(args, tmp_path, env) as first, TrainerClient(url) as trainer:
        first.wait_healthy(port)
        options = {"api_base": f"{slow_model.url}/v1"}
        episode = trainer.create_episode(policy="model:openai/gpt-4o-mini", policy_options=options)
        call = background(ask, sdk_agent(episode, retries=RESTART_RETRIES), "hello")
        # the model is at work on it, once the server has loaded litellm
        wait_until(lambda: slow_model.calls == 1, LITELLM_LOAD_S)
        kill_server(first)

    slow_model.answering.set()
    with serving(args, tmp_path, env) as second, TrainerClient(url) as trainer:
        second.wait_healthy(port)
        assert call.result(timeout=LITELLM_LOAD_S) == "upstream saw 1 messages"  # the new server loads it again
        assert trainer.next_turns(max=8, wait_s=0.5) == []  # no trainer ever sees it
        [turn] = trainer.trajectory(episode.id).turns
        assert turn.status == "answered"
        assert turn.reply is not None and turn.reply.answered_by == "model:openai/gpt-4o-mini"
    assert slow_model.calls == 2


# A database that stalls


@sqlite_only
@pytest.mark.settings(retry_grace_s=10)
def test_a_retry_while_its_first_attempt_is_still_being_recorded_joins_that_turn(
    server: LiveServer, trainer: TrainerClient, background: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="trajproxy")
    episode = trainer.create_episode()
    database = server.settings.database_url.removeprefix("sqlite:///")
    stall = sqlite3.connect(database, isolation_level=None, timeout=WAIT_S)
    try:
        stall.execute("BEGIN IMMEDIATE")  # the disk stalls: no write commits until it is over
        first = held_call(int(server.url.rsplit(":", 1)[1]), episode.key, "slow disk")
        wait_until(lambda: being_recorded(server, episode.id))  # the first attempt waits on the stalled database
        first.close()  # the agent gives up on it and retries, as SDKs do
        retry = background(raw_call, server.url, episode.key, "slow disk", 1, WAIT_S)
        wait_until(lambda: any(RETRY_WAITS in message for message in caplog.messages))  # on that first attempt
    finally:
        stall.execute("ROLLBACK")
        stall.close()
    [turn] = pull(trainer, 1)
    answer(trainer, [turn])
    assert retry.result(timeout=WAIT_S).json()["choices"][0]["message"]["content"] == "re: slow disk"
    assert [(t["text"], t["status"]) for t in recorded(server.settings.database_url)] == [("slow disk", "answered")]


RETRY_WAITS = "a retry waits for its first attempt's turn, still being recorded"  # proxy/core/retries.py, at debug


def being_recorded(server: LiveServer, episode_id: str) -> bool:
    """Whether a call of the episode is being recorded now, as the broker's live episode knows: nothing outside
    says so (the episode reads running only once the database has it)."""
    live = server.broker._episodes.get(episode_id)
    return live is not None and bool(live.recording)


# A trainer that crashes, or freezes, holding leases


@sqlite_only
@pytest.mark.settings(lease_s=30)
def test_a_crashed_trainers_turns_are_redelivered_and_its_leases_refused(
    server: LiveServer, trainer: TrainerClient, background: Any, actors: Actors, sdk_agent: Callable[..., openai.OpenAI]
) -> None:
    episodes = [trainer.create_episode() for _ in range(3)]
    calls = [background(ask, sdk_agent(e), f"question {i}") for i, e in enumerate(episodes)]
    wait_until(lambda: health(server.url)["ready_turns"] == 3)
    crashed = actors.start("trainer", server.url, "--turns", "3", "--lease-s", "1", token=server.token)
    held = actors.said(crashed)["pulled"]
    assert [turn["deliveries"] for turn in held] == [1, 1, 1]
    actors.kill(crashed)

    redelivered = pull(trainer, 3)  # once the dead trainer's leases run out
    assert sorted(turn.id for turn in redelivered) == sorted(turn["id"] for turn in held)
    assert [turn.deliveries for turn in redelivered] == [2, 2, 2]
    stale = {turn["id"]: turn["lease_id"] for turn in held}
    for turn in redelivered[:2]:
        with pytest.raises(TrajproxyAPIError) as refused:  # the crashed trainer's lease, after redelivery
            trainer.reply(turn.id, "from the dead", lease_id=stale[turn.id])
        assert refused.value.status == 409
        assert "expired" in refused.value.message
    answer(trainer, redelivered)
    with pytest.raises(TrajproxyAPIError) as refused:  # and after the turn is answered
        trainer.reply(redelivered[2].id, "from the dead", lease_id=stale[redelivered[2].id])
    assert refused.value.status == 409
    assert sorted(call.result(timeout=WAIT_S) for call in calls) == [f"re: question {i}" for i in range(3)]

    turns = recorded(server.settings.database_url)
    assert [(t["status"], t["deliveries"], t["reply"]) for t in turns] == [
        ("answered", 2, f"re: {t['text']}") for t in turns
    ]
    assert len(turns) == 3


@sqlite_only
@pytest.mark.settings(lease_s=30)
def test_a_frozen_trainers_late_replies_are_refused_and_the_live_trainers_stand(
    server: LiveServer, trainer: TrainerClient, background: Any, actors: Actors, sdk_agent: Callable[..., openai.OpenAI]
) -> None:
    episodes = [trainer.create_episode() for _ in range(4)]
    calls = [background(ask, sdk_agent(e), f"question {i}") for i, e in enumerate(episodes)]
    wait_until(lambda: health(server.url)["ready_turns"] == 4)
    frozen = actors.start("trainer", server.url, "--turns", "4", "--lease-s", "1", token=server.token)
    assert len(actors.said(frozen)["pulled"]) == 4
    frozen.send_signal(signal.SIGSTOP)  # a trainer stuck (a long GC pause, a swapped-out host) past its leases

    redelivered = pull(trainer, 4)
    answer(trainer, redelivered[:2])
    frozen.send_signal(signal.SIGCONT)
    actors.tell(frozen, "reply")  # it wakes and answers every turn it pulled, under its old leases
    assert actors.said(frozen) == {"statuses": [409, 409, 409, 409]}
    answer(trainer, redelivered[2:])
    assert sorted(call.result(timeout=WAIT_S) for call in calls) == [f"re: question {i}" for i in range(4)]

    turns = recorded(server.settings.database_url)
    assert len(turns) == 4
    assert all(t["status"] == "answered" and t["reply"] == f"re: {t['text']}" for t in turns)


# Agents and trainers that hang up mid-call


@sqlite_only
@pytest.mark.parametrize(
    ("when", "keepalive_s"),
    [("parked, before its stream starts", 30.0), ("leased, while keep-alives flow", 0.1)],
)
def test_an_agent_killed_mid_stream_abandons_its_turn(
    make_server: Callable[..., LiveServer], actors: Actors, when: str, keepalive_s: float
) -> None:
    server = make_server(keepalive_s=keepalive_s, retry_grace_s=0.5)
    with TrainerClient(server.url, server.token) as trainer:
        episode = trainer.create_episode()
        agent = actors.start("agent", server.url, episode.key, "streaming", "--stream")
        assert actors.said(agent) == {"calling": "streaming"}
        leased = None
        if when.startswith("leased"):
            assert actors.said(agent) == {"streaming": True}  # the response has begun: keep-alives are flowing
            [leased] = pull(trainer, 1)
        else:
            wait_until(lambda: health(server.url)["ready_turns"] == 1)
        actors.kill(agent)

        wait_until(lambda: trainer.trajectory(episode.id).turns[0].status == "abandoned")
        [turn] = trainer.trajectory(episode.id).turns
        assert turn.reason is not None and "disconnected" in turn.reason
        assert turn.deliveries == (1 if leased else 0)
        assert trainer.next_turns(max=8, wait_s=0.5) == []
        with pytest.raises(TrajproxyAPIError) as late:
            trainer.reply(turn.id, "too late", lease_id=leased.lease_id if leased else None)
        assert late.value.status == 409
        assert health(server.url)["open_turns"] == 0


@sqlite_only
def test_trainers_killed_mid_long_poll_take_no_turn_with_them(
    server: LiveServer, trainer: TrainerClient, background: Any, actors: Actors, sdk_agent: Callable[..., openai.OpenAI]
) -> None:
    pollers = [actors.start("poller", server.url, token=server.token) for _ in range(3)]
    for poller in pollers:
        assert actors.said(poller) == {"polling": True}
    wait_until(lambda: health(server.url)["waiting_pollers"] == 3)
    for poller in pollers:  # all at once, and the agents call straight after
        poller.kill()
    episodes = [trainer.create_episode() for _ in range(3)]
    calls = [background(ask, sdk_agent(e), f"question {i}") for i, e in enumerate(episodes)]

    # A turn handed to a dead poller would stay leased for its 120 s: the live trainer gets every one now.
    turns = pull(trainer, 3)
    answer(trainer, turns)
    assert sorted(call.result(timeout=WAIT_S) for call in calls) == [f"re: question {i}" for i in range(3)]
    wait_until(lambda: health(server.url)["waiting_pollers"] == 0)
    for poller in pollers:
        assert poller.wait(EXIT_S) == -signal.SIGKILL
    assert [t["status"] for t in recorded(server.settings.database_url)] == ["answered"] * 3
