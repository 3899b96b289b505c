"""The token ids a served policy's server answers with are checked before anything is recorded: ids that are not token
ids (a bool, a float, a negative number, one past 64 bits, a stray comma in the echo) fail the turn with a 502 in
the agent's dialect, on the first turn and on a continued one, where they are read after the ids already known. And
SGLang's own token endpoint (`/generate`: what was sampled at the top level, no choices) is read as it answers. Stand-in
servers: no real one answers such ids on demand, and no SGLang runs on this CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from fastapi import FastAPI, Request
from starlette.responses import Response

from proxy.client import TrainerClient
from testkit.vllm_server import build_tiny_model
from tests.conftest import serve_app

BAD_IDS = {  # as the server writes them, where the sampled ids or a continued echo's new ids go
    "a bool": b"true",
    "a float": b"7.5",
    "a negative id": b"-7",
    "an id past 63 bits": b"9223372036854775808",
    "an id past 64 bits": b"99999999999999999999999",
}


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return build_tiny_model()


def chat_server(bad: bytes, where: str) -> FastAPI:
    """A chat endpoint whose first answer is sound and whose second writes `bad` among the sampled ids (`where` is
    "sampled") or as its echo's one new id after the first turn's prompt and sampled ids ("echo")."""
    app = FastAPI()
    answered: list[int] = []

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Response:
        answered.append(1)
        first = len(answered) == 1
        echo = b"[1,2,3]" if first else b"[1,2,3,7," + (bad if where == "echo" else b"8") + b"]"
        sampled = b"[7]" if first or where == "echo" else b"[7," + bad + b"]"
        logprobs = (
            b'{"content":[' + b",".join([b'{"token":"a","logprob":-0.5}'] * (1 if sampled == b"[7]" else 2)) + b"]}"
        )
        message = b'{"role":"assistant","content":"hi"}'
        choice = b'{"index":0,"message":' + message + b',"finish_reason":"stop","token_ids":' + sampled
        body = b'{"id":"x","prompt_token_ids":' + echo + b',"choices":[' + choice + b',"logprobs":' + logprobs + b"}]}"
        return Response(body, media_type="application/json")

    return app


def talk(episode: Any, turns: int) -> openai.APIStatusError | None:
    """`turns` calls of one conversation; the error the last raised, if it did."""
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as agent:
        for _ in range(turns):
            try:
                reply = agent.chat.completions.create(model="policy", messages=messages)
            except openai.APIStatusError as e:
                return e
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "more"},
            ]
    return None


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("where", ["sampled", "echo"])
@pytest.mark.parametrize("bad", sorted(BAD_IDS))
@pytest.mark.timeout(60)
def test_ids_that_are_not_token_ids_fail_the_turn_and_nothing_is_recorded_as_answered(
    trainer: TrainerClient, bad: str, where: str
) -> None:
    running = serve_app(chat_server(BAD_IDS[bad], where))
    try:
        options = {"api_base": f"{running.live.url}/v1", "mode": "chat", "max_tokens": 8}
        episode = trainer.create_episode(policy="vllm:tiny", policy_options=options)
        failed = talk(episode, 2)
    finally:
        running.stop()
    assert failed is not None and failed.status_code == 502, bad
    assert "policy's server" in failed.message, failed.message
    first, second = trainer.trajectory(episode.id).turns
    assert first.reply is not None and list(first.reply.prompt_token_ids or ()) == [1, 2, 3]
    assert second.status == "failed" and second.reply is None, (second.status, second.reply)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.timeout(120)
def test_sglang_generate_answers_a_tokens_mode_turn_read_as_its_documented_shape(
    trainer: TrainerClient, tiny_model: Path
) -> None:
    """SGLang's `/generate` answers `{"text", "output_ids", "meta_info"}`, no choices: each such turn once failed as
    "answered with no choices". Its prompt ids are those sent, its sampled ids and logprobs from `meta_info`."""
    asked: list[Any] = []
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        asked.append(orjson.loads(await request.body()))
        meta = {"output_token_logprobs": [[-0.5, 11, "he"], [-0.25, 12, "llo"]], "finish_reason": {"type": "stop"}}
        return Response(orjson.dumps({"text": "hello", "output_ids": [11, 12], "meta_info": meta}))

    running = serve_app(app)
    try:
        options = {"api_base": f"{running.live.url}/v1", "tokenizer": str(tiny_model), "max_tokens": 8}
        episode = trainer.create_episode(policy="sglang:tiny", policy_options=options)
        with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as agent:
            reply = agent.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    finally:
        running.stop()
    assert reply.choices[0].message.content == "hello"
    (turn,) = trainer.trajectory(episode.id).turns
    assert turn.reply is not None and turn.reply.answered_by == "sglang:tiny"
    (sent,) = asked
    assert list(turn.reply.prompt_token_ids or ()) == sent["input_ids"] and len(sent["input_ids"]) > 3
    assert (list(turn.reply.completion_token_ids or ()), turn.reply.logprobs) == ([11, 12], [-0.5, -0.25])
    assert sent["sampling_params"]["max_new_tokens"] == 8
