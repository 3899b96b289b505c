"""PrometheusMetrics: the core's observer, as Prometheus metrics (`prometheus-client`) in a registry the app owns.

Counters and histograms move as the broker tells of changes (`proxy.core.observer`); the gauges (open turns,
long polls, episodes by status) are read when scraped. Labels are bounded: a turn's dialect (three) and status
(six), an episode's status (five); never an id, a key, a model name or a task.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from proxy.core.values import EpisodeStatus, Reward, Turn

CONTENT_TYPE = CONTENT_TYPE_LATEST
# From a trainer answering at once (milliseconds) to a person answering by hand (minutes).
LATENCY_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)
COMMIT_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What is true now, read at scrape time."""

    parked: int
    leased: int
    long_polls: int
    episodes: Mapping[EpisodeStatus, int]


class PrometheusMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._turns = Counter(
            "trajproxy_turns",
            "Turns by the status they reached: parked when recorded, then the status each ended in",
            ["status", "dialect"],
            registry=r,
        )

        def latency(name: str, documentation: str) -> Histogram:
            return Histogram(f"trajproxy_{name}_seconds", documentation, buckets=LATENCY_S, registry=r)

        self._park_to_pull = latency("park_to_pull", "From a turn's recording to its first lease by a trainer")
        self._pull_to_reply = latency("pull_to_reply", "From a turn's (latest) lease to its answer")
        self._reply_to_delivered = latency(
            "reply_to_delivered", "From a turn's answer to its reply handed to the agent's connection (its write too)"
        )
        self._rewards = Summary(
            "trajproxy_rewards", "Rewards recorded: how many, and the sum of their values", registry=r
        )
        self._commit = Histogram(
            "trajproxy_store_commit_seconds",
            "One database transaction of the store's writer",
            buckets=COMMIT_S,
            registry=r,
        )
        self._batch = Histogram(
            "trajproxy_store_commit_writes",
            "Writes committed in one transaction (group commit)",
            buckets=BATCH,
            registry=r,
        )
        self._sandbox_starts = Counter("trajproxy_sandbox_starts", "Sandboxes started in this process", registry=r)
        self._sandbox_failures = Counter(
            "trajproxy_sandbox_failures", "Sandboxes that failed to start in this process", registry=r
        )
        self._open = Gauge("trajproxy_open_turns", "Open turns now, parked or leased", ["status"], registry=r)
        self._long_polls = Gauge("trajproxy_long_polls_waiting", "Trainer long polls waiting for a turn", registry=r)
        self._episodes = Gauge("trajproxy_episodes", "Recorded episodes by status", ["status"], registry=r)

    # The core's observer

    def recorded(self, turn: Turn) -> None:
        self._turns.labels("parked", turn.dialect).inc()

    def leased(self, turns: Sequence[Turn]) -> None:
        for turn in turns:
            if turn.deliveries == 1 and turn.leased_at is not None:
                self._park_to_pull.observe(max(0.0, turn.leased_at - turn.created_at))

    def settled(self, turn: Turn) -> None:
        self._turns.labels(turn.status.value, turn.dialect).inc()
        if turn.answered_at is not None and turn.leased_at is not None:
            self._pull_to_reply.observe(max(0.0, turn.answered_at - turn.leased_at))

    def handed_over(self, turn: Turn, at: float) -> None:
        if turn.answered_at is not None:
            self._reply_to_delivered.observe(max(0.0, at - turn.answered_at))

    def rewarded(self, reward: Reward) -> None:
        self._rewards.observe(reward.value)

    # The store's and the sandboxes'

    def committed(self, writes: int, seconds: float) -> None:
        self._commit.observe(seconds)
        self._batch.observe(writes)

    def sandbox_started(self) -> None:
        self._sandbox_starts.inc()

    def sandbox_failed(self) -> None:
        self._sandbox_failures.inc()

    # Exposition

    def exposition(self, now: Snapshot) -> bytes:
        """The text format, with the gauges set to `now`."""
        self._open.labels("parked").set(now.parked)
        self._open.labels("leased").set(now.leased)
        self._long_polls.set(now.long_polls)
        for status in EpisodeStatus:
            self._episodes.labels(status.value).set(now.episodes.get(status, 0))
        return generate_latest(self.registry)
