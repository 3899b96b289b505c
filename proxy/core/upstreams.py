"""Upstreams: the models that answer turns in the trainer's place, one kind each, behind one interface."""

from __future__ import annotations

from collections.abc import Mapping

from proxy.core.errors import UpstreamError
from proxy.core.ports import Upstream
from proxy.core.values import JsonObject, ModelRoute, Reply


class Upstreams:
    """Sends each route to the upstream for its kind (`model`: litellm; `vllm`, `sglang`: the served policy)."""

    def __init__(self, by_kind: Mapping[str, Upstream]) -> None:
        self._by_kind = dict(by_kind)

    async def complete(self, route: ModelRoute, request: JsonObject) -> Reply:
        upstream = self._by_kind.get(route.kind)
        if upstream is None:
            raise UpstreamError(f"no upstream answers {route.spec} here")
        return await upstream.complete(route, request)
