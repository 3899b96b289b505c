"""`GET /health` (on TCP: the queue's counts, whether new calls are paused, the policy version) and `GET /` (the
name and version), served by FastAPI without a token; the sandbox socket's bare `/health` is
`proxy.http.sandbox_door`'s."""

from __future__ import annotations

import orjson
from starlette.responses import Response

from proxy import __version__
from proxy.core.broker import Broker


class Health:
    def __init__(self, broker: Broker, replica: str | None) -> None:
        self._broker = broker
        self._replica = replica  # one of several replicas sharing a Postgres database

    async def health(self) -> Response:
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
        return Response(orjson.dumps(status), media_type="application/json")


async def root() -> Response:
    return Response(orjson.dumps({"name": "trajproxy", "version": __version__}), media_type="application/json")
