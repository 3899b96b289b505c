"""A trainer's token-level generate call, backed by the real vLLM on the CPU: the stand-in for the GPU engine a
trainer would start (verl's server manager, SkyRL's engine client, slime's SGLang router), for the adapters' tests.

    generate = VllmGenerate(base_url, "tiny")      # base_url: http://127.0.0.1:PORT/v1
    generated = await generate("episode-key", prompt_ids, {"temperature": 1.0, "max_tokens": 64})
    generate.calls                                  # every (key, prompt ids, sampling, Generated), in order

Standard library and aiohttp only, so it runs in any of the trainers' environments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp

from integrations.token_server import Generated


@dataclass
class VllmGenerate:
    base_url: str
    model: str
    calls: list[tuple[str, list[int], dict[str, Any], Generated]] = field(default_factory=list)

    async def __call__(self, key: str, prompt_ids: list[int], sampling: dict[str, Any]) -> Generated:
        body = {
            "skip_special_tokens": False,
            **sampling,
            "model": self.model,
            "prompt": prompt_ids,
            "return_token_ids": True,
            "logprobs": 0,
        }
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.base_url}/completions", json=body, timeout=aiohttp.ClientTimeout(600)) as answer,
        ):
            response = await answer.json()
            if answer.status != 200:
                raise RuntimeError(f"vLLM answered {answer.status}: {response}")
        choice = response["choices"][0]
        assert choice["prompt_token_ids"] == prompt_ids  # the engine read what it was given
        generated = Generated(
            list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"]), choice["finish_reason"] or "stop"
        )
        self.calls.append((key, prompt_ids, sampling, generated))
        return generated
