"""A read of the records never waits on a model answering a turn: a served policy may sample for minutes, and a trainer
reading a trajectory (or the export) meanwhile gets what is recorded, the turn still open. A stand-in server that
holds its answer until the test lets it go (a real one is only slower to answer)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import openai
import pytest
from fastapi import FastAPI
from starlette.responses import JSONResponse, Response

from proxy.client import TrainerClient
from tests.conftest import serve_app


def held_server(received: threading.Event, release: threading.Event) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "tiny", "object": "model", "root": "tiny"}]}

    @app.post("/v1/chat/completions")
    async def complete() -> Response:
        received.set()
        await asyncio.to_thread(release.wait, 60)
        return JSONResponse({"error": {"message": "out of memory"}}, 500)

    return app


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.timeout(90)
def test_a_trajectory_is_read_while_a_model_answers_one_of_its_turns(
    server: Any, trainer: TrainerClient, background: Any
) -> None:
    received, release = threading.Event(), threading.Event()
    running = serve_app(held_server(received, release))
    options = {"api_base": f"{running.live.url}/v1", "mode": "chat", "max_tokens": 8}
    try:
        episode = trainer.create_episode(policy="vllm:tiny", policy_options=options)
        agent = openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0)
        with agent:
            call = background(
                agent.chat.completions.create, model="policy", messages=[{"role": "user", "content": "hi"}]
            )
            assert received.wait(30), "the call never reached the policy's server"
            # Before, the read waited for every model answering a turn, here until the server let go (60 s)
            (turn,) = background(trainer.trajectory, episode.id).result(timeout=20).turns
            assert (turn.status, turn.reply) == ("parked", None)  # as recorded: open, not yet answered
            release.set()
            with pytest.raises(openai.APIStatusError) as failed:
                call.result(timeout=30)
    finally:
        release.set()
        running.stop()
    assert failed.value.status_code == 502
    (turn,) = trainer.trajectory(episode.id).turns
    assert turn.status == "failed" and "out of memory" in (turn.reason or "")
