"""LitellmUpstream: answers turns from any model litellm reaches; the one module that imports litellm.

litellm takes seconds to import, so it is imported on the first forwarded turn, off the event loop,
and never at start-up. Its price list is read from the copy it ships (no fetch at run time).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from proxy.core.errors import UpstreamError
from proxy.core.values import Answerer, JsonObject, Reply, Turn, Usage

# Request fields that describe the agent's HTTP exchange with trajproxy, not the model call.
_EXCHANGE_FIELDS = frozenset({"model", "stream", "stream_options", "n"})


class LitellmUpstream:
    def __init__(self) -> None:
        self._litellm: Any = None
        self._importing = asyncio.Lock()

    async def complete(self, answerer: Answerer, request: JsonObject, parent: Turn | None = None) -> Reply:
        litellm = await self._load()
        model, options = answerer.model, answerer.options
        params = {k: v for k, v in request.items() if k not in _EXCHANGE_FIELDS}
        try:
            response = await litellm.acompletion(model=model, **params, **options)
        except Exception as e:  # litellm raises many types; each is the upstream's failure
            raise UpstreamError(f"model {model!r} failed: {type(e).__name__}: {e}") from e
        choice = response.choices[0]
        message = {
            k: v
            for k, v in choice.message.model_dump().items()
            if v is not None and k in ("role", "content", "tool_calls", "reasoning_content")
        }
        message["role"] = "assistant"
        message.setdefault("content", None)
        usage = getattr(response, "usage", None)
        return Reply(
            message=message,
            finish_reason=choice.finish_reason or ("tool_calls" if message.get("tool_calls") else "stop"),
            usage=Usage(usage.prompt_tokens, usage.completion_tokens) if usage else None,
            cost_usd=_cost(litellm, model, response),
        )

    async def _load(self) -> Any:
        async with self._importing:
            if self._litellm is None:
                self._litellm = await asyncio.to_thread(_import_litellm)
        return self._litellm


def _cost(litellm: Any, model: str, response: Any) -> float | None:
    """The call's price in USD from litellm's bundled cost table; None for a model the table does not know."""
    try:
        return float(litellm.completion_cost(completion_response=response, model=model))
    except Exception:  # litellm raises for models missing from its table
        return None


def _import_litellm() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read before the import, never fetched
    # lazy: litellm takes seconds to import, and only calls a hosted model answers need it
    import litellm

    litellm.telemetry = False
    litellm.suppress_debug_info = True  # its "Give Feedback" banner on every failed call: the error says it all
    return litellm
