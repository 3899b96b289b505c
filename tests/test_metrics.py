"""GET /metrics: Prometheus text whose figures match what the trainer API says after a known workload; open to a
scraper without the token, yet with no id, key or token in it, and labels from small fixed sets."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.adapters.litellm_upstream import LitellmUpstream
from proxy.adapters.prometheus_metrics import PrometheusMetrics
from proxy.adapters.tiktoken_counter import TiktokenCounter
from proxy.client import TrainerClient
from proxy.core.broker import Broker
from proxy.core.context import Context
from proxy.core.errors import EpisodeClosed
from proxy.core.shared_queue import SharedQueue
from proxy.core.values import EpisodeStatus, TurnStatus, new_id
from proxy.storage.postgres_queue import PostgresQueue
from proxy.storage.sql import SqlStore
from tests.conftest import fresh_database
from tests.test_architecture import imports_of, modules, name_of
from tests.test_queue_contract import ANSWER, WAIT_S, call

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(server: Any) -> tuple[str, Samples]:
    response = httpx.get(f"{server.url}/metrics", timeout=10)  # no token: see proxy/http/metrics.py
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return response.text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def until(condition: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError("the condition did not come true in time")
        time.sleep(0.02)
    return result


def chat(episode: Any, text: str) -> Any:
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as agent:
        return agent.chat.completions.create(model="policy", messages=[{"role": "user", "content": text}])


def claude(episode: Any, text: str) -> Any:
    with anthropic.Anthropic(base_url=episode.env["ANTHROPIC_BASE_URL"], api_key=episode.key, max_retries=0) as agent:
        return agent.messages.create(model="policy", max_tokens=50, messages=[{"role": "user", "content": text}])


def pulled(trainer: TrainerClient, episode_id: str) -> Any:
    [turn] = trainer.next_turns(episode=episode_id, wait_s=10)
    return turn


def test_metrics_match_the_api_after_a_known_workload(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    answered = trainer.create_episode(task="answered twice")
    refused = trainer.create_episode(task="handed an error")
    failed = trainer.create_episode(task="finished while a call waits")
    waiting = trainer.create_episode(task="a call parked")
    held = trainer.create_episode(task="a call leased")

    for text in ("one", "two"):  # chat, answered by the trainer
        call = background(chat, answered, text)
        trainer.reply(pulled(trainer, answered.id).id, f"re {text}")
        assert call.result(timeout=10).choices[0].message.content == f"re {text}"
    call = background(claude, refused, "hello")  # anthropic, answered with an error for the agent
    trainer.reply(pulled(trainer, refused.id).id, error={"status": 400, "message": "no", "type": "invalid_request"})
    with pytest.raises(anthropic.BadRequestError):
        call.result(timeout=10)
    doomed = background(chat, failed, "wait")
    pulled(trainer, failed.id)
    trainer.finish(failed.id, "failed", "stopped by the test")
    with pytest.raises(openai.APIStatusError):
        doomed.result(timeout=10)
    parked = background(chat, waiting, "park me")
    leased_call = background(chat, held, "lease me")
    leased = pulled(trainer, held.id)
    until(lambda: trainer.trajectory(waiting.id).turns)
    trainer.finish(answered.id, "finished")
    trainer.add_reward(answered.id, 1.0)
    trainer.add_reward(answered.id, 0.5, "style")
    trainer.add_reward(failed.id, -2.0)
    poll = background(trainer.next_turns, episode=refused.id, wait_s=30)  # nothing will come: it waits
    until(lambda: httpx.get(f"{server.url}/health").json()["waiting_pollers"] == 1)

    # What the API says
    episodes = trainer.episodes().episodes
    by_status = Counter(episode.status for episode in episodes)
    turns = [turn for episode in episodes for turn in trainer.trajectory(episode.id).turns]
    ended = Counter((turn.status, turn.dialect) for turn in turns if turn.status not in ("parked", "leased"))
    rewards = [reward.value for episode in episodes for reward in trainer.trajectory(episode.id).rewards]
    health = httpx.get(f"{server.url}/health").json()

    # The deliveries are told just after the agents have their replies: wait for them, not for time
    until(lambda: value(scrape(server)[1], "trajproxy_reply_to_delivered_seconds_count") >= 3)
    text, samples = scrape(server)
    assert value(samples, "trajproxy_reply_to_delivered_seconds_count") == 3  # two chat replies, one error
    for status in ("pending", "running", "finished", "failed", "cancelled"):
        assert value(samples, "trajproxy_episodes", status=status) == by_status.get(status, 0), status
    assert by_status == {"running": 3, "finished": 1, "failed": 1}
    for dialect in ("chat", "anthropic"):
        recorded = sum(turn.dialect == dialect for turn in turns)
        assert value(samples, "trajproxy_turns_total", status="parked", dialect=dialect) == recorded
    assert ended == {("answered", "chat"): 2, ("answered", "anthropic"): 1, ("failed", "chat"): 1}
    for (status, dialect), n in ended.items():
        assert value(samples, "trajproxy_turns_total", status=status, dialect=dialect) == n
    assert value(samples, "trajproxy_open_turns", status="parked") == 1
    assert value(samples, "trajproxy_open_turns", status="leased") == 1
    assert health["open_turns"] == 2 and health["ready_turns"] == 1
    assert value(samples, "trajproxy_long_polls_waiting") == health["waiting_pollers"] == 1
    assert value(samples, "trajproxy_rewards_count") == len(rewards) == 3
    assert value(samples, "trajproxy_rewards_sum") == sum(rewards) == -0.5
    assert value(samples, "trajproxy_park_to_pull_seconds_count") == 5  # every pulled turn, once
    assert value(samples, "trajproxy_pull_to_reply_seconds_count") == 3  # the answered ones
    assert value(samples, "trajproxy_store_commit_seconds_count") > 0
    assert value(samples, "trajproxy_store_commit_writes_sum") >= len(turns) + len(episodes) + len(rewards)
    assert value(samples, "trajproxy_sandbox_starts_total") == 0  # no run in this process

    # Nothing in it names an episode, a turn, a key or the token
    secrets = [server.token] + [e.id for e in episodes] + [t.id for t in turns]
    secrets += [e.key for e in (answered, refused, failed, waiting, held)]
    assert not [secret for secret in secrets if secret and secret in text]
    trainer.reply(leased.id, "done")
    assert leased_call.result(timeout=10).choices[0].message.content == "done"
    trainer.finish(waiting.id, "cancelled")
    trainer.finish(refused.id, "finished")  # wakes the long poll
    assert poll.result(timeout=10) == []
    with pytest.raises(openai.APIStatusError):
        parked.result(timeout=10)


def test_labels_come_from_small_fixed_sets(server: Any, trainer: TrainerClient) -> None:
    for i in range(3):
        trainer.create_episode(task=f"task {i}", metadata={"run": f"r{i}"})
    _, samples = scrape(server)
    allowed = {
        "status": {"pending", "running", "finished", "failed", "cancelled", "parked", "leased", "answered"}
        | {"abandoned", "expired"},
        "dialect": {"chat", "anthropic", "responses"},
        "le": None,
    }
    for name, labels in samples:
        assert name.startswith("trajproxy_"), name
        for label, text in labels:
            assert label in allowed, (name, label)
            values = allowed[label]
            assert values is None or text in values, (name, label, text)
    assert value(samples, "trajproxy_episodes", status="pending") == 3


def test_metrics_need_no_token_but_the_api_still_does(server: Any) -> None:
    assert server.token
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.get(f"{server.url}/api/episodes").status_code == 401


def test_prometheus_is_imported_in_its_adapter_alone() -> None:
    importers = {name_of(path) for path in modules() if any(i.root == "prometheus_client" for i in imports_of(path))}
    assert importers == {"proxy/adapters/prometheus_metrics.py"}


def test_each_turn_ends_once_in_the_fleet_in_the_metrics_of_the_replica_holding_it(tmp_path: Any) -> None:
    """Replicas sharing a database: a turn held by one and answered, or failed by its episode's finish, through
    another counts once, where it was parked (as its `parked` count is), never on the replica that acted on it."""

    async def body(url: str) -> None:
        async with replica(url) as (a, a_metrics), replica(url) as (b, b_metrics):
            episode, _ = await a.create_episode("task", {})
            answer = await call(a, episode.id, "answered on b")
            (pulled,) = await b.queue.pull(episode.id, 1, WAIT_S, None)
            await b.answers.reply(pulled.id, ANSWER, pulled.lease_id)
            assert (await asyncio.wait_for(answer, WAIT_S)).status is TurnStatus.ANSWERED
            answer = await call(a, episode.id, "failed on b")
            await b.finish(episode.id, EpisodeStatus.CANCELLED, "stopped")
            with pytest.raises(EpisodeClosed):
                await asyncio.wait_for(answer, WAIT_S)

        def turns(metrics: PrometheusMetrics, status: str) -> float:
            return (
                metrics.registry.get_sample_value("trajproxy_turns_total", {"status": status, "dialect": "chat"}) or 0
            )

        assert [turns(a_metrics, status) for status in ("parked", "answered", "failed")] == [2, 1, 1]
        assert [turns(b_metrics, status) for status in ("parked", "answered", "failed")] == [0, 0, 0]

    with fresh_database("postgres", tmp_path) as url:
        asyncio.run(asyncio.wait_for(body(url), WAIT_S * 3))


@asynccontextmanager
async def replica(url: str) -> AsyncIterator[tuple[Broker, PrometheusMetrics]]:
    """One replica of several sharing the database at `url`, in this process, with metrics of its own."""
    metrics = PrometheusMetrics()
    store = SqlStore(url, replica=new_id("rp"))
    await store.open()
    context = Context.build(
        store=store,
        tokens=TiktokenCounter(),
        upstream=LitellmUpstream(),
        lease_s=WAIT_S,
        turn_timeout_s=WAIT_S,
        observer=metrics,
    )
    shared = SharedQueue(context=context, database=PostgresQueue(store, dead_after_s=WAIT_S))
    broker = Broker(context=context, queue=shared, others=shared)
    await broker.start()
    try:
        yield broker, metrics
    finally:
        await broker.drain()
        await broker.stop()
        await store.close()
