"""GET /metrics: Prometheus text format, with no token.

A scraper gets aggregate figures only (counts, sums, latencies; no id, key, task or model name), and Prometheus
scrapes without credentials by default; asking for the trainer token here would mean handing the token that
answers agents and records rewards to every monitoring system. Like the trainer API, it is not served on the
sandboxes' Unix socket: agents have no business reading it. Put it behind your network's rules like any exporter.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.responses import Response

from proxy.adapters.prometheus_metrics import CONTENT_TYPE, PrometheusMetrics, Snapshot
from proxy.core.broker import Broker
from proxy.core.catalog import Catalog
from proxy.core.errors import Forbidden
from proxy.http.sandbox_door import from_sandbox


def on_sandbox_socket(request: Request) -> bool:
    """Whether the request came over the Unix socket sandboxes' gates relay agents to (it has no port)."""
    return from_sandbox(request.scope)


def add_metrics(app: FastAPI, metrics: PrometheusMetrics, broker: Broker, catalog: Catalog) -> None:
    @app.get("/metrics", include_in_schema=False)
    async def scrape(request: Request) -> Response:
        if on_sandbox_socket(request):
            raise Forbidden("/metrics is not served on the sandbox socket; use trajproxy's TCP address")
        leased = broker.leased_turns
        now = Snapshot(
            parked=broker.open_turns - leased,
            leased=leased,
            long_polls=broker.queue.waiting,
            episodes=await catalog.episode_counts(),
        )
        return Response(metrics.exposition(now), media_type=CONTENT_TYPE)
