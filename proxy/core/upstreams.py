"""Upstreams: the models that answer turns in the trainer's place, one kind each, behind one interface."""

from __future__ import annotations

from collections.abc import Mapping

from proxy.core.errors import UpstreamError
from proxy.core.ports import Upstream
from proxy.core.values import Answerer, JsonObject, Reply, Turn


class Upstreams:
    """Sends each answerer's calls to its kind's upstream (`model`: litellm; `vllm`, `sglang`: the served policy)."""

    def __init__(self, by_kind: Mapping[str, Upstream]) -> None:
        self._by_kind = dict(by_kind)

    async def complete(self, answerer: Answerer, request: JsonObject, parent: Turn | None = None) -> Reply:
        upstream = self._by_kind.get(answerer.kind)
        if upstream is None:
            raise UpstreamError(f"no upstream answers {answerer.spec} here")
        return await upstream.complete(answerer, request, parent)
