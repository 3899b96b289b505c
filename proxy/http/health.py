"""`GET /health` (on TCP: the queue's counts, whether new calls are paused, the policy version) and `GET /` (the
name and version), plain handlers without a token; the sandbox socket's bare `/health` is `proxy.http.edge`'s."""

from __future__ import annotations

import orjson
from starlette.types import Receive, Scope, Send

from proxy import __version__
from proxy.core.broker import Broker
from proxy.http.edge import respond

ROOT = orjson.dumps({"name": "trajproxy", "version": __version__})


class Health:
    def __init__(self, broker: Broker, replica: str | None) -> None:
        self._broker = broker
        self._replica = replica  # one of several replicas sharing a Postgres database

    async def __call__(self, _scope: Scope, _receive: Receive, send: Send) -> None:
        broker = self._broker
        status = {
            "status": "ok",
            "open_turns": broker.open_turns,
            "ready_turns": broker.ready_turns,
            "waiting_pollers": broker.queue.waiting,
            "paused": broker.weights.paused,
            "policy_version": broker.weights.policy_version,
        }
        if self._replica is not None:
            status["replica"] = self._replica
        await respond(send, 200, orjson.dumps(status))


async def root(_scope: Scope, _receive: Receive, send: Send) -> None:
    await respond(send, 200, ROOT)
