"""A served policy's hostile output in tokens mode: a long one is read off the event loop (the server keeps
answering while it is parsed), and one that breaks JSON reaches the agent as text, the turn saying why and keeping
the sampled ids. A stand-in token server says what was sampled (a real model does not sample these on demand);
the tokenizer and template are the tiny model's, as in every tokens-mode test."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from proxy.adapters.tool_parsers import PARSERS
from proxy.client import TrainerClient
from testkit.vllm_server import build_tiny_model
from tests.conftest import LiveServer, Running, serve_app

SAMPLED = [11, 12, 13]  # the ids the stand-in says it sampled, whatever the text
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "parameters": {"type": "object", "properties": {"timeout": {"type": "integer"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return build_tiny_model()


@pytest.fixture
def sampler() -> Iterator[tuple[Running, list[str]]]:
    """A token server that answers each call with the next text of its list."""
    texts: list[str] = []
    app = FastAPI()

    @app.post("/v1/completions")
    async def complete(request: Request) -> JSONResponse:
        body = await request.json()
        choice = {"index": 0, "text": texts.pop(0), "token_ids": SAMPLED, "finish_reason": "stop"}
        return JSONResponse({"id": "c", "choices": [{**choice, "prompt_token_ids": body["prompt"]}]})

    running = serve_app(app)
    yield running, texts
    running.stop()


def episode_of(trainer: TrainerClient, sampler: Running, tiny_model: Path, tool_parser: str) -> Any:
    options: dict[str, Any] = {"api_base": sampler.live.url + "/v1", "mode": "tokens", "tokenizer": str(tiny_model)}
    options |= {"tool_parser": tool_parser, "max_tokens": 8}
    return trainer.create_episode(policy="vllm:tiny", policy_options=options, turn_timeout_s=30)


def ask(episode: Any) -> Any:
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        messages: Any = [{"role": "user", "content": "go"}]
        return client.chat.completions.create(model="p", messages=messages, tools=TOOLS).choices[0].message


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.timeout(120)
def test_a_long_output_is_parsed_off_the_event_loop(
    server: LiveServer, trainer: TrainerClient, sampler: tuple[Running, list[str]], tiny_model: Path
) -> None:
    # Thousands of typed calls, the last of them broken: every call is read before the output turns out not to
    # parse, and the agent gets one string back, quick to hand over.
    call = "<function=bash>\n<parameter=timeout>\n7\n</parameter>\n</function>\n"
    text = "<tool_call>\n" + call * 60_000 + "<function=bash>\nstray\n</function>\n</tool_call>"
    running, texts = sampler
    texts.extend(["Loaded.", text])
    episode = episode_of(trainer, running, tiny_model, "qwen3_coder")
    assert ask(episode).content == "Loaded."  # the first call loads the tokenizer, on a thread of its own
    gc.disable()  # a full collection stops every thread, wherever the parsing is done; timeit turns it off too
    try:
        started = time.perf_counter()
        assert PARSERS["qwen3_coder"].parse(text, TOOLS).error
        parsing_s = time.perf_counter() - started
        with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.url) as health:
            reply = pool.submit(ask, episode)
            longest_s = 0.0
            while not reply.done():
                started = time.perf_counter()
                assert health.get("/health").status_code == 200
                longest_s = max(longest_s, time.perf_counter() - started)
            assert reply.result().content == text
    finally:
        gc.enable()
    # On the loop, /health would wait about as long as the parsing takes; on a thread, a few switches of the GIL.
    assert longest_s < parsing_s / 2, f"/health waited {longest_s:.3f} s; parsing takes {parsing_s:.3f} s"


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.timeout(120)
def test_output_that_breaks_json_reaches_the_agent_as_text_with_its_ids(
    trainer: TrainerClient, sampler: tuple[Running, list[str]], tiny_model: Path
) -> None:
    running, texts = sampler
    outputs = {
        "nested too deep": '<tool_call>\n{"name": "bash", "arguments": ' + "[" * 100_000 + "\n</tool_call>",
        "a number too long": '<tool_call>\n{"name": "bash", "arguments": {"timeout": '
        + "7" * 5_000
        + "}}\n</tool_call>",
    }
    texts.extend(outputs.values())
    episode = episode_of(trainer, running, tiny_model, "hermes")
    for why, text in outputs.items():
        message = ask(episode)
        assert (message.content, message.tool_calls) == (text, None), why
    trainer.finish(episode.id)
    for turn in trainer.trajectory(episode.id).turns:
        assert turn.reply and turn.reply.served and turn.reply.served["parse_error"].startswith("hermes: ")
        assert list(turn.reply.completion_token_ids or ()) == SAMPLED
