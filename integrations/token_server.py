"""A trainer's token-level generate call, served as vLLM's completions endpoint with token-id prompts, so that
trajproxy's tokens mode answers an episode's parked turns through it: the chat template, the continuation of parent
turns, the tool parsing and the branches stay trajproxy's, the engine, its routing and its weights the trainer's.

    async with token_server(generate, tokenizer="/models/qwen") as server:
        policy_options = {"api_base": server.api_base("episode-7"), "mode": "tokens", ...}

Each rollout gets its own base URL, `/r/<key>/v1`, and every call under it reaches `generate(key, prompt_ids,
sampling)`: the key is the sticky id trainers route by (verl's request id, SkyRL's session id, slime's routing key).
It listens on loopback only: the trajproxy that calls it runs in the same process (`integrations.rollouts`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from aiohttp import web

from proxy.adapters.chat_templates import ChatTemplates

# What vLLM's completions request carries for trajproxy's tokens mode that is not sampling (served_tokens.py)
_NOT_SAMPLING = frozenset({"model", "prompt", "return_token_ids", "logprobs", "stream", "skip_special_tokens"})
FINISH_REASONS = ("stop", "length", "abort")
POLICY_VERSION = "policy_version"  # the answer's field naming the weights that sampled it (served_tokens.py reads it)


@dataclass(frozen=True, slots=True)
class Generated:
    """What a trainer's generate call sampled: the ids, their logprobs (one per id, or None: never made up), why it
    stopped ("abort": the engine dropped the request, as a weight update may; the turn fails, its episode is flagged
    an infrastructure failure), and the version of the weights that sampled it, as the trainer names them (verl's
    global steps, SkyRL's and slime's weight versions): the turn's policy version, which `max_staleness` bounds."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str = "stop"
    policy_version: str | None = None


@dataclass(slots=True)
class ResponseBudget:
    """A rollout's response budget over all of its calls (verl's `response_length`, slime's
    `rollout_max_response_len`): the ids after its first call's prompt (each call's sampled ids and the environment's
    between them) may not pass `total`, so each call's `max_tokens` is held to what is left (at least 1: an engine
    refuses 0; the trainer's own cut then keeps the line within the budget). A prompt that does not continue the
    first (a rewritten history, another branch) starts from the whole budget."""

    total: int
    first: list[int] | None = None

    def max_tokens(self, prompt_ids: list[int], asked: int | None) -> int:
        if self.first is None:
            self.first = list(prompt_ids)
        first = self.first
        extends = prompt_ids[: len(first)] == first
        left = self.total - (len(prompt_ids) - len(first)) if extends else self.total
        return max(1, min(int(asked or self.total), left))


# generate(key, prompt_ids, sampling): sampling as vLLM names it (temperature, top_p, max_tokens, stop, seed, ...)
Generate = Callable[[str, list[int], dict[str, Any]], Awaitable[Generated]]


@dataclass(frozen=True, slots=True)
class TokenServer:
    url: str
    model: str

    def api_base(self, key: str) -> str:
        """The OpenAI-style base URL whose calls reach `generate` with this key."""
        return f"{self.url}/r/{quote(key, safe='')}/v1"


@contextlib.asynccontextmanager
async def token_server(generate: Generate, tokenizer: str, model: str = "policy") -> AsyncIterator[TokenServer]:
    """Serve `generate` on 127.0.0.1 (a free port) until the block ends; `tokenizer`: the model's folder (or hub
    name), whose tokenizer turns the sampled ids into the text trajproxy parses (special tokens kept)."""
    decode = (await asyncio.to_thread(ChatTemplates().get, tokenizer)).decode

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(i, int) for i in prompt):
            return _error(400, "prompt: a list of token ids is expected")
        sampling = {k: v for k, v in body.items() if k not in _NOT_SAMPLING}
        generated = await generate(request.match_info["key"], prompt, sampling)
        if generated.finish_reason == "abort":
            return _error(503, "the trainer's engine aborted the request")
        ids, logprobs = list(generated.token_ids), generated.logprobs
        choice = {
            "index": 0,
            "text": decode(ids),
            "token_ids": ids,
            "prompt_token_ids": prompt,
            "logprobs": {"token_logprobs": list(logprobs)} if logprobs is not None else None,
            "finish_reason": generated.finish_reason,
        }
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}
        answer = {"object": "text_completion", "model": model, "choices": [choice], "usage": usage}
        if generated.policy_version is not None:
            answer[POLICY_VERSION] = str(generated.policy_version)
        return web.json_response(answer)

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model", "root": tokenizer}]})

    app = web.Application()
    app.router.add_post("/r/{key}/v1/completions", completions)
    app.router.add_get("/r/{key}/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield TokenServer(f"http://127.0.0.1:{port}", model)
    finally:
        await runner.cleanup()


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)
