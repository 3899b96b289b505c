"""`--policy model:NAME` when the model fails: the agent's call comes back at once as a 502 carrying the
provider's message, in the agent's own dialect, instead of waiting out the turn timeout; the turn is recorded failed
with that message (no trainer answered it), and the run says so too.

In process against a fake provider that answers 500 with a message of its own (the three SDKs), an episode created
with the policy as `trajproxy run` creates them; and end to end: a `trajproxy run` of the minimal agent in a sandbox,
its model a real litellm name on a closed port."""

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

from proxy.client import TrainerClient
from sandbox.run.policies import ModelPolicy
from testkit.tasks import EXAMPLE
from tests.conftest import FakeModel
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
    server: Any, trainer: TrainerClient, fake_model: FakeModel, dialect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-fake")  # a key is trajproxy's to hold, never an episode's option
    options = {key: value for key, value in fake_model.options().items() if key != "api_key"}
    policy = ModelPolicy("model:openai/fake-teacher", options)
    episode = trainer.create_episode(**policy.episode)  # as `trajproxy run --policy model:NAME` creates each
    with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as raised:  # far within the turn timeout
        asyncio.run(answered(CALLS[dialect](episode)))
    failed = raised.value
    assert isinstance(failed, (openai.APIStatusError, anthropic.APIStatusError))
    assert failed.status_code == 502
    assert "the model is down" in failed.response.text  # the provider's own words, in the agent's dialect
    body = failed.response.json()
    error = body["error"]
    assert "the model is down" in error["message"]
    assert ("type" in body and body["type"] == "error") == (dialect == "anthropic messages")
    [turn] = trainer.trajectory(episode.id).turns
    assert turn.status == "failed" and "the model is down" in (turn.reason or "")
    assert turn.reply is None  # no trainer answered it


async def answered(call: Awaitable[Any]) -> Any:
    return await call


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
    assert "model 'openai/gpt-4o-mini' failed" in done.stderr  # what the run printed of the call its model failed
    assert "(its agent got the error at once)" in done.stderr
    assert "[agent] the model call failed: 502" in done.stderr  # the agent's own output, one line
    [line] = [json.loads(text) for text in results.read_text().splitlines()]
    assert (line["status"], line["reward"]) == ("failed", 0.0)
    with sqlite3.connect(database) as db:
        turns = db.execute("SELECT status, reason, answered_by FROM turn").fetchall()
        [(policy,)] = db.execute("SELECT policy FROM episode").fetchall()
    assert "openai/gpt-4o-mini" in policy  # the episode's own policy: trajproxy answered, not the run
    assert turns and all(status == "failed" and "failed" in reason for status, reason, _ in turns), turns
    assert {by for _, _, by in turns} == {None}  # the model's failure, no trainer's answer
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
