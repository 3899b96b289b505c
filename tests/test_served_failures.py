"""An agent whose served policy's server fails is told that it failed, never where it is: `api_base` may carry
credentials, and the agent runs model-written code. A stand-in server (a real one is not what fails here)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from fastapi import FastAPI
from starlette.responses import JSONResponse, PlainTextResponse, Response

from proxy.client import TrainerClient
from testkit.family_checks import tokenizer
from tests.conftest import serve_app

SECRET = "s3cret-in-the-url"
FAILURES = {
    "down": None,  # the server stopped before the call
    "error": lambda: JSONResponse({"error": {"message": "out of memory"}}, 500),
    "not json": lambda: PlainTextResponse("<html>bad gateway</html>"),
    "no choices": lambda: JSONResponse({"id": "x", "choices": []}),
    "no token ids": lambda: JSONResponse(
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}
    ),
}
SAID = {
    "down": "could not be reached",
    "error": "answered 500: out of memory",
    "not json": "other than JSON",
    "no choices": "no choices",
    "no token ids": "without the token ids",
}


def failing_server(how: str, root: str = "tiny") -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "tiny", "object": "model", "root": root}]}

    @app.post("/v1/chat/completions")
    async def complete() -> Response:
        answer = FAILURES[how]
        assert answer is not None
        return answer()

    return app


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # what the agent is told, not where it is kept
@pytest.mark.parametrize("how", sorted(FAILURES))
@pytest.mark.timeout(60)
def test_an_agent_is_told_its_served_policy_failed_but_not_where_it_is(
    server: Any, trainer: TrainerClient, how: str
) -> None:
    running = serve_app(failing_server(how))
    where = running.live.url.removeprefix("http://")  # 127.0.0.1:<port>
    options = {"api_base": f"http://trainer:{SECRET}@{where}/v1", "mode": "chat", "max_tokens": 8}
    try:
        episode = trainer.create_episode(policy="vllm:tiny", policy_options=options)
        if how == "down":
            running.stop()
        agent = openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0)
        with agent, pytest.raises(openai.APIStatusError) as failed:
            agent.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    finally:
        if how != "down":
            running.stop()
    assert failed.value.status_code == 502
    told = failed.value.message
    assert SAID[how] in told and "policy's server" in told, told
    assert SECRET not in told and where not in told and "/v1" not in told, told
    (turn,) = trainer.trajectory(episode.id).turns
    assert turn.status == "failed" and SECRET not in (turn.reason or "") and where not in (turn.reason or "")


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.timeout(60)  # the turn's own timeout is 300 s: a turn left open until then fails the test
def test_a_fault_making_the_answer_fails_the_turn_at_once_not_at_its_timeout(
    server: Any, trainer: TrainerClient, tmp_path: Any
) -> None:
    """Something other than the server can fail while trajproxy makes a served answer: here the episode's chat template
    divides by zero as it renders (jinja passes Python's error through, not a template error). The agent hears a 502
    at once, the turn is recorded failed with the error's kind, and the next call is answered as usual."""
    tokenizer("chatml").save_pretrained(tmp_path)
    running = serve_app(failing_server("error", root=str(tmp_path)))
    options = {"api_base": f"{running.live.url}/v1", "mode": "tokens", "chat_template": "{{ 1 / 0 }}", "max_tokens": 8}
    try:
        episode = trainer.create_episode(policy="vllm:tiny", policy_options=options, turn_timeout_s=300)
        agent = openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0)
        with agent, pytest.raises(openai.APIStatusError) as failed:
            agent.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    finally:
        running.stop()
    assert failed.value.status_code == 502
    assert "ZeroDivisionError" in failed.value.message and "could not be made" in failed.value.message
    (turn,) = trainer.trajectory(episode.id).turns
    assert turn.status == "failed" and "ZeroDivisionError" in (turn.reason or ""), turn.reason
