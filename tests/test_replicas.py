"""Replicas sharing one Postgres (`trajproxy serve --shared`), as real processes: a turn parked on one is pulled
through another and answered through a third; two trainers on two replicas never get the same turn; a long poll on
one is woken by a call parked on another; a replica killed while its agents wait costs no call and makes none
twice (their SDK retries, through a balancer, land on the others); and what must be refused is."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy
from openai.types.chat import ChatCompletionMessageParam

from proxy.client import TrainerClient
from proxy.storage.engines import engine_url
from testkit.databases import fresh_schema
from tests.conftest import POSTGRES_URL
from tests.test_cli import clean_env, free_port, trajproxy_script

START_S = 30  # a cold interpreter imports fastapi, sqlalchemy and pydantic; the box is shared and slow

pytestmark = pytest.mark.skipif(
    not POSTGRES_URL and not os.environ.get("CI"),
    reason="no Postgres server: set TRAJPROXY_TEST_POSTGRES_URL (bash .ci/run starts one and sets it)",
)


@pytest.fixture
def shared_url() -> Iterator[str]:
    """A fresh, empty schema of its own on the test Postgres server (advisory locks and the tables are per schema)."""
    if not POSTGRES_URL:
        pytest.fail("CI must run the Postgres tests: .ci/run sets TRAJPROXY_TEST_POSTGRES_URL")
    with fresh_schema(POSTGRES_URL) as url:
        yield url


@dataclass
class Replica:
    url: str
    process: subprocess.Popen[str]
    database_url: str

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/health", timeout=5).json())


class Replicas:
    """Starts `trajproxy serve --shared` processes on one schema, all with one trainer token: `replicas(n, *flags)`."""

    def __init__(self, shared_url: str) -> None:
        self.shared_url = shared_url
        self.token = f"test-trainer-{secrets.token_hex(8)}"
        self.started: list[Replica] = []
        self.trainers: dict[str, TrainerClient] = {}  # one on each replica, by its url

    def __call__(self, n: int, *flags: str) -> list[Replica]:
        batch = []
        for _ in range(n):
            port = free_port()
            command = [
                *(trajproxy_script(), "serve", "--shared", "--port", str(port), "--database-url", self.shared_url),
                *("--trainer-token", self.token, "--keepalive-s", "0.2", "--replica-dead-s", "2", *flags),
            ]
            process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env()
            )
            batch.append(Replica(f"http://127.0.0.1:{port}", process, self.shared_url))
        for replica in batch:
            _wait_up(replica)
            self.trainers[replica.url] = TrainerClient(replica.url, token=self.token, timeout_s=120)
        self.started.extend(batch)
        return batch


@pytest.fixture
def replicas(shared_url: str) -> Iterator[Replicas]:
    """Start `trajproxy serve --shared` processes on the test's schema; all stop after the test."""
    started = Replicas(shared_url)
    yield started
    for trainer in started.trainers.values():
        trainer.close()
    for replica in started.started:
        if replica.process.poll() is None:
            replica.process.terminate()
    for replica in started.started:
        try:
            replica.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            replica.process.kill()
            replica.process.wait()
        if replica.process.stdout:
            replica.process.stdout.close()


def _wait_up(replica: Replica) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if replica.process.poll() is not None:
            out = replica.process.stdout.read() if replica.process.stdout else ""
            pytest.fail(f"a replica exited at start: {out}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{replica.url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    pytest.fail("a replica did not start")


def until(condition: Callable[[], bool], what: str, limit_s: float = 90) -> None:
    """Wait for something the test cannot be told of; the limit only keeps a broken build from hanging."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {limit_s:g} s for {what}")
        time.sleep(0.05)


def trainer_on(replica: Replica, replicas: Replicas) -> TrainerClient:
    return replicas.trainers[replica.url]


def agent(url: str, key: str, **options: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=options.pop("max_retries", 0), **options)


def ask(client: openai.OpenAI, *messages: str) -> str:
    said: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": text} if i % 2 == 0 else {"role": "assistant", "content": text}
        for i, text in enumerate(messages)
    ]
    with client:  # each agent asks once
        reply = client.chat.completions.create(model="policy", messages=said)
    return reply.choices[0].message.content or ""


def turn_rows(url: str, *more: str) -> list[Any]:
    engine = sqlalchemy.create_engine(engine_url(url))
    columns = ", ".join(["episode_id", "seq", "status", "replica", *more])
    try:
        with engine.connect() as conn:
            return list(conn.execute(sqlalchemy.text(f"SELECT {columns} FROM turn ORDER BY created_at")))
    finally:
        engine.dispose()


def test_a_turn_parked_on_one_replica_is_pulled_on_another_and_answered_on_a_third(replicas: Replicas) -> None:
    a, b, c = replicas(3)
    episode = trainer_on(a, replicas).create_episode(task="across replicas")
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(ask, agent(a.url, episode.key), "hello")
        [turn] = trainer_on(b, replicas).next_turns(wait_s=60)
        assert (turn.episode_id, turn.seq, turn.status) == (episode.id, 0, "leased")
        trainer_on(c, replicas).reply(turn.id, "from c", lease_id=turn.lease_id)
        assert first.result(timeout=60) == "from c"

        # The agent's next call lands on another replica: it carries on the same episode, as its next turn.
        second = pool.submit(ask, agent(b.url, episode.key), "hello", "from c", "and then?")
        [turn] = trainer_on(c, replicas).next_turns(wait_s=60)
        assert (turn.episode_id, turn.seq, turn.parent_id) == (episode.id, 1, first_turn_id(a, replicas, episode.id))
        trainer_on(a, replicas).reply(turn.id, "from a", lease_id=turn.lease_id)
        assert second.result(timeout=60) == "from a"
        again = trainer_on(b, replicas).reply(turn.id, "from a", lease_id=turn.lease_id)  # the same reply: fine
        assert again.status == "answered"
        with pytest.raises(Exception, match="different reply"):
            trainer_on(c, replicas).reply(turn.id, "another", lease_id=turn.lease_id)

        # And back to the first replica, which last saw the episode at its first call: it catches up.
        third = pool.submit(ask, agent(a.url, episode.key), "hello", "from c", "and then?", "from a", "last one")
        [last] = trainer_on(b, replicas).next_turns(wait_s=60)
        assert (last.seq, last.parent_id) == (2, turn.id)
        trainer_on(b, replicas).reply(last.id, "from b", lease_id=last.lease_id)
        assert third.result(timeout=60) == "from b"
    trajectory = trainer_on(c, replicas).trajectory(episode.id)
    assert [(t.seq, t.status) for t in trajectory.turns] == [(0, "answered"), (1, "answered"), (2, "answered")]


def first_turn_id(replica: Replica, replicas: Replicas, episode_id: str) -> str:
    return trainer_on(replica, replicas).trajectory(episode_id).turns[0].id


def test_two_trainers_on_two_replicas_never_get_the_same_turn(replicas: Replicas) -> None:
    a, b = replicas(2)
    seed = random.Random(17)
    calls = 40
    episodes = [trainer_on(a, replicas).create_episode(task=f"t{i}") for i in range(calls)]
    with ThreadPoolExecutor(max_workers=calls + 2) as pool:
        agents = [pool.submit(ask, agent(seed.choice([a, b]).url, e.key), f"call {i}") for i, e in enumerate(episodes)]

        def drain(replica: Replica, rng: random.Random) -> list[Any]:
            got: list[Any] = []
            trainer = trainer_on(replica, replicas)
            while True:
                batch = trainer.next_turns(max=rng.randint(1, 4), wait_s=3)
                if not batch:
                    return got
                got += batch

        pulled = [pool.submit(drain, replica, random.Random(i)) for i, replica in enumerate((a, b))]
        on_a, on_b = (future.result(timeout=120) for future in pulled)
        ids_a, ids_b = {t.id for t in on_a}, {t.id for t in on_b}
        assert len(ids_a) == len(on_a) and len(ids_b) == len(on_b)  # nobody got one twice
        assert not ids_a & ids_b  # and no two trainers got the same
        assert len(ids_a | ids_b) == calls  # every call was handed out
        for turns, replica in ((on_a, b), (on_b, a)):  # each answered through the other replica
            trainer = trainer_on(replica, replicas)
            for turn in turns:
                trainer.reply(turn.id, f"answer to {turn.episode_id}", lease_id=turn.lease_id)
        assert [future.result(timeout=60) for future in agents] == [f"answer to {e.id}" for e in episodes]


def test_a_lease_run_out_on_one_replica_is_redelivered_on_another_and_the_stale_reply_refused(
    replicas: Replicas,
) -> None:
    a, b = replicas(2)
    episode = trainer_on(a, replicas).create_episode(task="slow trainer")
    with ThreadPoolExecutor(max_workers=1) as pool:
        call = pool.submit(ask, agent(a.url, episode.key), "anyone?")
        [first] = trainer_on(a, replicas).next_turns(wait_s=60, lease_s=0.5)
        [again] = trainer_on(b, replicas).next_turns(wait_s=60)  # once the lease runs out, b's long poll gets it
        assert (again.id, again.deliveries) == (first.id, 2)
        with pytest.raises(Exception, match="expired"):
            trainer_on(a, replicas).reply(first.id, "late", lease_id=first.lease_id)
        trainer_on(b, replicas).reply(again.id, "on time", lease_id=again.lease_id)
        assert call.result(timeout=60) == "on time"


def test_an_episode_finished_on_one_replica_fails_its_agent_waiting_on_another(replicas: Replicas) -> None:
    a, b = replicas(2)
    episode = trainer_on(a, replicas).create_episode(task="cut short")
    with ThreadPoolExecutor(max_workers=1) as pool:
        call = pool.submit(ask, agent(a.url, episode.key), "still there?")
        until(lambda: bool(turn_rows(a.database_url)), "the call to be parked")
        trainer_on(b, replicas).finish(episode.id, "cancelled", reason="enough")
        with pytest.raises(openai.APIStatusError) as refused:
            call.result(timeout=60)
    assert refused.value.status_code in (409, 410)
    assert "cancelled" in refused.value.message
    [row] = turn_rows(a.database_url)
    assert row.status == "failed"


def test_a_long_poll_on_one_replica_is_woken_by_a_call_parked_on_another(replicas: Replicas) -> None:
    a, b = replicas(2)
    episode = trainer_on(a, replicas).create_episode(task="wake me")
    with ThreadPoolExecutor(max_workers=2) as pool:
        poll = pool.submit(trainer_on(b, replicas).next_turns, wait_s=100)
        until(lambda: b.health()["waiting_pollers"] > 0, "the long poll to wait")
        call = pool.submit(ask, agent(a.url, episode.key), "anyone?")
        [turn] = poll.result(timeout=90)  # woken by the notice: a missed one would leave it empty after 100 s
        assert turn.episode_id == episode.id
        trainer_on(a, replicas).reply(turn.id, "here", lease_id=turn.lease_id)
        assert call.result(timeout=60) == "here"


def test_a_replica_killed_while_its_agents_wait_costs_no_call_and_makes_none_twice(replicas: Replicas) -> None:
    fleet = replicas(3, "--restart-grace-s", "120")
    with Balancer([r.url for r in fleet]) as balancer, ThreadPoolExecutor(max_workers=16) as pool:
        trainer = trainer_on(fleet[0], replicas)
        episodes = [trainer.create_episode(task=f"t{i}") for i in range(9)]
        agents: list[Future[str]] = [
            pool.submit(ask, agent(balancer.url, e.key, max_retries=5, timeout=90), f"call {i}")
            for i, e in enumerate(episodes)
        ]
        until(lambda: len(turn_rows_of(fleet)) == len(episodes), "every call to be parked")
        holders = {row.replica for row in turn_rows_of(fleet)}
        victim = next(r for r in fleet if r.health()["replica"] in holders)
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait()
        survivors = [r for r in fleet if r is not victim]

        answered = 0
        while answered < len(episodes):  # every call comes to a trainer once, wherever its agent now waits
            for turn in trainer_on(survivors[answered % 2], replicas).next_turns(max=4, wait_s=5):
                trainer_on(survivors[1], replicas).reply(
                    turn.id, f"answer to {turn.episode_id}", lease_id=turn.lease_id
                )
                answered += 1
        assert [future.result(timeout=90) for future in agents] == [f"answer to {e.id}" for e in episodes]
    rows = turn_rows_of(fleet)
    assert sorted((row.episode_id, row.seq, row.status) for row in rows) == sorted(
        (e.id, 0, "answered") for e in episodes
    )


def turn_rows_of(fleet: list[Replica]) -> list[Any]:
    return turn_rows(fleet[0].database_url)


@pytest.mark.parametrize("said", [True, False], ids=["retry said", "retry unsaid"])
def test_a_turn_whose_agent_hung_up_leaves_every_queue_until_its_retry_comes_back_on_another(
    replicas: Replicas, said: bool
) -> None:
    """With `x-stainless-retry-count`, or without it (the Gemini SDK): no second turn."""
    a, b = replicas(2, "--retry-grace-s", "60")
    episode = trainer_on(a, replicas).create_episode(task="flaky network")
    body = b'{"model":"policy","messages":[{"role":"user","content":"are you there?"}]}'
    headers = {"authorization": f"Bearer {episode.key}", "content-type": "application/json"}
    with pytest.raises(httpx.TimeoutException):  # the agent hangs up while its call is parked on a
        httpx.post(f"{a.url}/v1/chat/completions", content=body, headers=headers, timeout=1)
    until(lambda: turn_rows(a.database_url, "held_for")[0].held_for == "agent", "the turn to leave the queue")
    assert trainer_on(b, replicas).next_turns(wait_s=0) == []  # no trainer anywhere gets it meanwhile
    with ThreadPoolExecutor(max_workers=1) as pool:
        retried = {**headers, "x-stainless-retry-count": "1"} if said else headers
        retry = pool.submit(httpx.post, f"{b.url}/v1/chat/completions", content=body, headers=retried, timeout=60)
        [turn] = trainer_on(a, replicas).next_turns(wait_s=60)  # back in the queue, held by b now
        trainer_on(a, replicas).reply(turn.id, "yes", lease_id=turn.lease_id)
        assert retry.result(timeout=60).json()["choices"][0]["message"]["content"] == "yes"
    [row] = turn_rows(a.database_url)
    assert (row.seq, row.status, row.replica) == (0, "answered", b.health()["replica"])


def test_a_reply_lost_with_its_agent_is_replayed_to_its_unsaid_retry_on_another_replica(replicas: Replicas) -> None:
    """A call answered after its agent hung up (its reply recorded, handed to nobody), retried through another
    replica by a client that does not say it retries: it gets that reply, and the episode keeps one turn."""
    a, b = replicas(2, "--retry-grace-s", "60")
    episode = trainer_on(a, replicas).create_episode(task="lost reply")
    body = b'{"model":"policy","messages":[{"role":"user","content":"are you there?"}]}'
    headers = {"authorization": f"Bearer {episode.key}", "content-type": "application/json"}
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(httpx.post, f"{a.url}/v1/chat/completions", content=body, headers=headers, timeout=3)
        [turn] = trainer_on(a, replicas).next_turns(wait_s=60)  # leased while its agent waits
        with pytest.raises(httpx.TimeoutException):
            first.result(timeout=60)
    trainer_on(b, replicas).reply(turn.id, "recorded, never sent", lease_id=turn.lease_id)
    retry = httpx.post(f"{b.url}/v1/chat/completions", content=body, headers=headers, timeout=60)
    assert retry.json()["choices"][0]["message"]["content"] == "recorded, never sent", retry.text
    [row] = turn_rows(a.database_url)
    assert (row.seq, row.status) == (0, "answered")


def test_a_turn_whose_agent_never_comes_back_is_taken_over_and_abandoned(replicas: Replicas) -> None:
    a, b = replicas(2, "--restart-grace-s", "1")
    episode = trainer_on(b, replicas).create_episode(task="left behind")
    with ThreadPoolExecutor(max_workers=1) as pool:
        call = pool.submit(ask, agent(a.url, episode.key), "are you there?")  # no retries: it never comes back
        until(lambda: bool(turn_rows(a.database_url)), "the call to be parked")
        held_by = a.health()["replica"]
        a.process.send_signal(signal.SIGKILL)
        a.process.wait()
        with pytest.raises(openai.APIConnectionError):
            call.result(timeout=60)
    # b hears a's silence, takes the turn over; nobody comes back for it within the restart grace
    until(lambda: turn_rows(b.database_url)[0].status != "parked", "the turn to be settled")
    row = turn_rows(b.database_url)[0]
    assert (row.status, row.replica) == ("abandoned", b.health()["replica"])
    assert row.replica != held_by
    reason = trainer_on(b, replicas).trajectory(episode.id).turns[0].reason
    assert reason is not None and "did not come back" in reason


def test_a_pause_on_one_replica_holds_calls_on_every_one_until_resumed_on_any(replicas: Replicas) -> None:
    a, b, c = replicas(3)
    episode = trainer_on(a, replicas).create_episode(task="weights")
    trainer_on(a, replicas).pause("hold")
    until(lambda: b.health()["paused"] == "hold", "b to hear of the pause")
    with ThreadPoolExecutor(max_workers=1) as pool:
        call = pool.submit(ask, agent(b.url, episode.key), "held?")
        until(lambda: bool(turn_rows(a.database_url)), "the call to be parked")
        assert trainer_on(c, replicas).next_turns(wait_s=1) == []  # held: no trainer anywhere gets it
        assert trainer_on(c, replicas).resume().paused is None
        [turn] = trainer_on(a, replicas).next_turns(wait_s=60)
        trainer_on(a, replicas).reply(turn.id, "new weights", lease_id=turn.lease_id)
        assert call.result(timeout=60) == "new weights"
    until(lambda: b.health()["paused"] is None, "b to hear of the resume")


def test_a_resume_naming_a_policy_version_on_one_replica_stamps_replies_recorded_on_every_one(
    replicas: Replicas,
) -> None:
    a, b = replicas(2)
    episode = trainer_on(a, replicas).create_episode(task="weights")
    trainer_on(b, replicas).pause("hold")
    assert trainer_on(b, replicas).resume(policy_version="step-3").policy_version == "step-3"
    until(lambda: a.health()["policy_version"] == "step-3", "a to hear of the new weights")
    with ThreadPoolExecutor(max_workers=1) as pool:
        call = pool.submit(ask, agent(b.url, episode.key), "which weights?")
        [turn] = trainer_on(a, replicas).next_turns(wait_s=60)
        answered = trainer_on(a, replicas).reply(turn.id, "step 3's", lease_id=turn.lease_id)
        assert call.result(timeout=60) == "step 3's"
    assert answered.reply is not None and answered.reply.policy_version == "step-3"
    reply = trainer_on(b, replicas).trajectory(episode.id).turns[0].reply
    assert reply is not None and reply.policy_version == "step-3"


def test_a_lone_process_and_replicas_exclude_each_other_and_sqlite_is_never_shared(
    replicas: Replicas, shared_url: str, tmp_path: Any
) -> None:
    replicas(1)
    lone = subprocess.run(
        [trajproxy_script(), "serve", "--port", str(free_port()), "--database-url", shared_url],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert lone.returncode != 0
    assert "trajproxy: another trajproxy process serves this Postgres database" in lone.stderr, lone.stderr
    assert "Traceback" not in lone.stderr

    sqlite = subprocess.run(
        [trajproxy_script(), "serve", "--shared", "--database-url", f"sqlite:///{tmp_path}/one.db"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert sqlite.returncode != 0
    assert sqlite.stderr.strip().splitlines() == [
        "trajproxy: --shared needs Postgres (--database-url postgresql://...): replicas share one Postgres "
        "database; a SQLite database is served by one process"
    ]


class Balancer:
    """A round-robin TCP load balancer (a test's stand-in for HAProxy): each connection goes to the next backend
    that accepts it, skipping those that refuse."""

    def __init__(self, backends: list[str]) -> None:
        self._backends = [(url.split(":")[1].lstrip("/"), int(url.rsplit(":", 1)[1])) for url in backends]
        self._next = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    def __enter__(self) -> Balancer:
        self._thread.start()
        server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._relay, "127.0.0.1", 0), self._loop)
        self._server = server.result(timeout=10)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *_exc: object) -> None:
        async def close() -> None:
            self._server.close()
            relays = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in relays:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        for _ in range(len(self._backends)):
            host, port = self._backends[self._next % len(self._backends)]
            self._next += 1
            try:
                backend_reader, backend_writer = await asyncio.open_connection(host, port)
                break
            except OSError:
                continue
        else:
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, backend_writer), _pipe(backend_reader, client_writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            writer.close()


# Races between a trainer's answer and a replica taking a turn over, made to happen in order: the test holds the
# turn's row lock, or answers the turn in the very transaction that takes it (a deferred trigger).

_ANSWERED = """UPDATE turn SET status = 'answered', answered_at = extract(epoch from now()),
    ended_at = extract(epoch from now()), lease_expires_at = NULL, answered_by = 'trainer',
    reply = CAST('{"message": {"role": "assistant", "content": "answered meanwhile"}, "finish_reason": "stop"}' AS json)
WHERE id = :id"""  # in the trigger, NEW.id
_ANSWER_WHEN_TAKEN = (
    """CREATE FUNCTION answer_when_taken() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
    {answered};
    RETURN NULL;
END $$""",
    """CREATE CONSTRAINT TRIGGER answer_when_taken AFTER UPDATE OF replica ON turn DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (OLD.replica IS DISTINCT FROM NEW.replica) EXECUTE FUNCTION answer_when_taken()""",
)


def hung_up_call(a: Replica, key: str) -> tuple[str, bytes, dict[str, str]]:
    """A call parked on `a` whose agent hung up (its turn out of every queue, waiting for the retry): its turn's
    id, body and the retry's headers."""
    body = b'{"model":"policy","messages":[{"role":"user","content":"are you there?"}]}'
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{a.url}/v1/chat/completions", content=body, headers=headers, timeout=1)
    until(lambda: turn_rows(a.database_url, "held_for")[0].held_for == "agent", "the turn to leave the queue")
    [row] = turn_rows(a.database_url, "id")
    return row.id, body, {**headers, "x-stainless-retry-count": "1"}


def test_a_retry_whose_turn_is_answered_while_it_looks_for_it_gets_that_answer_not_a_second_turn(
    replicas: Replicas,
) -> None:
    a, b = replicas(2, "--retry-grace-s", "60", "--turn-timeout-s", "20")
    episode = trainer_on(a, replicas).create_episode(task="answered meanwhile")
    turn_id, body, retried = hung_up_call(a, episode.key)
    engine = sqlalchemy.create_engine(engine_url(a.database_url))
    try:
        with engine.connect() as lock, ThreadPoolExecutor(max_workers=1) as pool:
            lock.execute(sqlalchemy.text("SELECT id FROM turn WHERE id = :id FOR UPDATE"), {"id": turn_id})
            me = lock.execute(sqlalchemy.text("SELECT pg_backend_pid()")).scalar()
            retry = pool.submit(httpx.post, f"{b.url}/v1/chat/completions", content=body, headers=retried, timeout=60)

            def waiting() -> bool:  # asked outside the lock's transaction, which sees one snapshot of the activity
                with engine.connect() as conn:
                    blocked = "SELECT count(*) FROM pg_stat_activity WHERE :me = ANY(pg_blocking_pids(pid))"
                    return bool(conn.execute(sqlalchemy.text(blocked), {"me": me}).scalar())

            # b found no answer for the retry, and waits to take the open turn: a trainer answers it first
            until(waiting, "b to wait for the turn")
            lock.execute(sqlalchemy.text(_ANSWERED), {"id": turn_id})
            lock.commit()
            assert retry.result(timeout=60).json()["choices"][0]["message"]["content"] == "answered meanwhile"
    finally:
        engine.dispose()
    assert [(row.seq, row.status) for row in turn_rows(a.database_url)] == [(0, "answered")]


@pytest.mark.parametrize("taken_by", ["retry", "takeover"])
def test_an_answer_heard_before_a_replica_takes_its_turn_reaches_the_agent(replicas: Replicas, taken_by: str) -> None:
    a, b = replicas(2, "--retry-grace-s", "60", "--turn-timeout-s", "20")
    episode = trainer_on(a, replicas).create_episode(task="heard early")
    turn_id, body, retried = hung_up_call(a, episode.key)
    engine = sqlalchemy.create_engine(engine_url(a.database_url))
    try:
        with engine.begin() as conn:  # b hears the answer before it holds the turn (the notice comes first)...
            conn.execute(sqlalchemy.text("SELECT pg_notify('trajproxy_answered', :id)"), {"id": turn_id})
            # ...and the answer is committed with the statement that gives b the turn
            for statement in _ANSWER_WHEN_TAKEN:
                conn.execute(sqlalchemy.text(statement.replace("{answered}", _ANSWERED.replace(":id", "NEW.id"))))
    finally:
        engine.dispose()
    trainer_on(a, replicas).pause("hold")  # notices arrive in order: once b hears of the pause, it heard the answer
    until(lambda: b.health()["paused"] == "hold", "b to hear of the pause")
    trainer_on(a, replicas).resume()
    until(lambda: b.health()["paused"] is None, "b to hear of the resume")
    if taken_by == "takeover":
        a.process.send_signal(signal.SIGKILL)
        a.process.wait()
        until(lambda: turn_rows(b.database_url)[0].replica == b.health()["replica"], "b to take the turn over")
    reply = httpx.post(f"{b.url}/v1/chat/completions", content=body, headers=retried, timeout=60)
    assert reply.json()["choices"][0]["message"]["content"] == "answered meanwhile"
    assert [(row.seq, row.status) for row in turn_rows(b.database_url)] == [(0, "answered")]
