"""`--policy model:NAME` when the model fails: the agent's call comes back at once as a 502 carrying the
provider's message, in the agent's own dialect, instead of waiting out the turn timeout; the run says so too.

In process against a fake provider that answers 500 with a message of its own (the three SDKs), and end to end: a
`trajproxy run` of the minimal agent in a sandbox, its model a real litellm name on a closed port."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sqlite3
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from proxy.client import AsyncTrainerClient
from sandbox.run.policies import ModelPolicy
from tests.conftest import EXAMPLE, FakeModel
from tests.test_launch import RUN, into

TURN_TIMEOUT_S = 600.0  # far past every test's own timeout: an answer within the test is not the timeout's


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/trajproxy.db"


async def chat(episode: Any, stream: bool) -> Any:
    async with openai.AsyncOpenAI(
        base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0
    ) as client:
        asked: Any = [{"role": "user", "content": "please fail"}]
        return await client.chat.completions.create(model="agent-model", messages=asked, stream=stream)


async def responses(episode: Any) -> Any:
    async with openai.AsyncOpenAI(
        base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0
    ) as client:
        return await client.responses.create(model="agent-model", input="please fail")


async def messages(episode: Any) -> Any:
    async with anthropic.AsyncAnthropic(
        base_url=episode.env["ANTHROPIC_BASE_URL"], api_key=episode.key, max_retries=0
    ) as client:
        asked: Any = [{"role": "user", "content": "please fail"}]
        return await client.messages.create(model="agent-model", max_tokens=64, messages=asked)


CALLS: dict[str, Callable[[Any], Awaitable[Any]]] = {
    "chat": lambda episode: chat(episode, stream=False),
    "chat streamed": lambda episode: chat(episode, stream=True),
    "responses": responses,
    "anthropic messages": messages,
}


@pytest.mark.settings(turn_timeout_s=TURN_TIMEOUT_S, keepalive_s=TURN_TIMEOUT_S)
@pytest.mark.parametrize("dialect", list(CALLS))
def test_a_failed_model_call_reaches_its_agent_at_once_as_a_502_with_the_providers_message(
    server: Any, fake_model: FakeModel, dialect: str
) -> None:
    heard: list[tuple[str, str]] = []

    async def main() -> tuple[str, Exception]:
        told = asyncio.Event()

        def hear(episode_id: str, message: str) -> None:
            heard.append((episode_id, message))
            told.set()

        async with AsyncTrainerClient(server.url, token=server.token) as trainer:
            episode = await trainer.create_episode()
            policy = ModelPolicy("openai/fake-teacher", fake_model.options(), hear)
            serving = asyncio.create_task(policy.serve(trainer, episode.id))
            try:  # the turn timeout is far past the test's own: an answer at all is not the timeout's
                await CALLS[dialect](episode)
            except (openai.APIStatusError, anthropic.APIStatusError) as e:
                await asyncio.wait_for(told.wait(), 10)  # the run hears of it too, once its forward returns
                return episode.id, e
            finally:
                serving.cancel()
            pytest.fail("the agent's call succeeded")

    episode_id, failed = asyncio.run(main())
    assert isinstance(failed, (openai.APIStatusError, anthropic.APIStatusError))
    assert failed.status_code == 502
    assert "the model is down" in failed.response.text  # the provider's own words, in the agent's dialect
    body = failed.response.json()
    error = body["error"]
    assert "the model is down" in error["message"]
    assert ("type" in body and body["type"] == "error") == (dialect == "anthropic messages")
    [(episode, said)] = heard
    assert episode == episode_id and "the model is down" in said


def closed_port() -> int:
    """A loopback port nothing listens on: a model behind it fails at once, as one unreachable offline would."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.timeout(240)
def test_a_run_whose_model_fails_hands_its_agent_the_502_and_prints_it(
    tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    database = tmp_path / "run.db"
    results = tmp_path / "results.jsonl"
    nowhere = f"http://127.0.0.1:{closed_port()}/v1"
    env = {
        **os.environ,
        "OPENAI_BASE_URL": nowhere,  # litellm's openai/ models go there (it reads either name)
        "OPENAI_API_BASE": nowhere,
        "OPENAI_API_KEY": "sk-offline",
        "TRAJPROXY_TURN_TIMEOUT_S": str(TURN_TIMEOUT_S),
    }
    command = [*RUN, str(EXAMPLE / "tasks.jsonl"), "--agent", "minimal", "--policy", "model:openai/gpt-4o-mini"]
    done = subprocess.run(
        [*command, "--label", label, "--results", str(results), *into(database)],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    assert done.returncode == 0, done.stderr  # the task ran: its agent failed, and was graded
    assert "model 'openai/gpt-4o-mini' failed" in done.stderr  # what the run printed as the call failed
    assert "(its agent got a 502)" in done.stderr
    assert "[agent] the model call failed: 502" in done.stderr  # the agent's own output, one line
    [line] = [json.loads(text) for text in results.read_text().splitlines()]
    assert (line["status"], line["reward"]) == ("failed", 0.0)
    with sqlite3.connect(database) as db:
        turns = db.execute("SELECT status, reply, answered_by FROM turn").fetchall()
    assert turns and all(status == "answered" and "failed" in reply for status, reply, _ in turns), turns
    assert {by for _, _, by in turns} == {"model:openai/gpt-4o-mini"}  # the model's failure, not the trainer's
    assert not engine.containers.list(all=True, filters={"label": label})


def test_a_run_passes_its_policy_options_to_the_model(
    tmp_path: Path, task_image: str, engine: Any, label: str, fake_model: FakeModel
) -> None:
    """`--policy-option KEY=VALUE` reaches the model's call: here its api_base (the fake provider) and temperature,
    which before could be given only through litellm's own environment variables."""
    database = tmp_path / "run.db"
    env = {**os.environ, "OPENAI_API_KEY": "sk-offline", "TRAJPROXY_TURN_TIMEOUT_S": str(TURN_TIMEOUT_S)}
    options = [f"api_base={fake_model.url}/v1", "temperature=0.25", "max_retries=0"]
    command = [*RUN, str(EXAMPLE / "tasks.jsonl"), "--agent", "minimal", "--policy", "model:openai/fake-teacher"]
    for option in options:
        command += ["--policy-option", option]
    done = subprocess.run(
        [*command, "--label", label, *into(database)], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stderr
    assert fake_model.seen, "the model was never called"
    assert {(asked["model"], asked["temperature"]) for asked in fake_model.seen} == {("fake-teacher", 0.25)}
    with sqlite3.connect(database) as db:
        answered_by = {by for (by,) in db.execute("SELECT answered_by FROM turn")}
    assert answered_by == {"model:openai/fake-teacher"}
    assert not engine.containers.list(all=True, filters={"label": label})
