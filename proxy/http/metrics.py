"""GET /metrics: Prometheus text format, with no token.

A scraper gets aggregate figures only (counts, sums, latencies; no id, key, task or model name), and Prometheus
scrapes without credentials by default; asking for the trainer token here would mean handing the token that
answers agents and records rewards to every monitoring system. Like the trainer API, it is not served on the
sandboxes' Unix socket: agents have no business reading it. Put it behind your network's rules like any exporter.
"""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from proxy.adapters.prometheus_metrics import CONTENT_TYPE, PrometheusMetrics, Snapshot
from proxy.core.broker import Broker
from proxy.core.catalog import Catalog
from proxy.core.errors import Forbidden
from proxy.http.edge import error_body, from_sandbox, respond

ON_SOCKET = "/metrics is not served on the sandbox socket; use trajproxy's TCP address"


class Metrics:
    """The plain handler of `GET /metrics`."""

    def __init__(self, metrics: PrometheusMetrics, broker: Broker, catalog: Catalog) -> None:
        self._metrics = metrics
        self._broker = broker
        self._catalog = catalog

    async def __call__(self, scope: Scope, _receive: Receive, send: Send) -> None:
        if from_sandbox(scope):  # the table never routes it there; said here too, where it is served
            await respond(send, 403, error_body(Forbidden.kind, ON_SOCKET))
            return
        broker = self._broker
        leased = broker.leased_turns
        now = Snapshot(
            parked=broker.open_turns - leased,
            leased=leased,
            long_polls=broker.queue.waiting,
            episodes=await self._catalog.episode_counts(),
        )
        await respond(send, 200, self._metrics.exposition(now), [(b"content-type", CONTENT_TYPE.encode())])
