"""`trajproxy run --policy model:NAME` and `vllm:NAME` answer in trajproxy itself: each episode is created with the
policy, and the broker sends every call to the model as it parks. The run asks the trainer API nothing per turn: a
handful of requests per episode (create it, record its reward, finish it) however many calls its agent makes.

Counted at a trajproxy the test serves (`--proxy-url`): every HTTP request it receives, by path. The agent's calls
come in through the socket of the same server, so the count of calls is taken there too."""

from __future__ import annotations

import json
import secrets
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from proxy.app import create_app
from proxy.settings import Settings
from testkit.tasks import EXAMPLE
from tests.conftest import FakeModel, serve_app
from tests.test_launch import RUN

TURN_TIMEOUT_S = 600.0
PER_EPISODE = 4  # create, reward, finish, and for a failed task the read of its turns (what its model failed)


@dataclass
class Counted:
    """An ASGI app that notes the path of every HTTP request before handing it on to trajproxy."""

    app: Any
    paths: list[str] = field(default_factory=list)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)

    def trainer_api(self) -> list[str]:
        return [path for path in self.paths if path.startswith("/api/")]

    def agent_calls(self) -> list[str]:
        return [path for path in self.paths if path.endswith("/chat/completions")]


@dataclass
class CountedProxy:
    url: str
    token: str
    socket: str
    counted: Counted


@pytest.fixture
def counted_proxy(tmp_path: Path, socket_dir: str) -> Iterator[CountedProxy]:
    token = f"test-trainer-{secrets.token_hex(8)}"
    settings = Settings(
        _env_file=None,
        database_url=f"sqlite:///{tmp_path}/counted.db",
        trainer_token=SecretStr(token),
        socket_path=f"{socket_dir}/proxy.sock",
        turn_timeout_s=TURN_TIMEOUT_S,
    )
    counted = Counted(create_app(settings))
    running = serve_app(counted, settings)
    try:
        yield CountedProxy(running.live.url, token, f"{socket_dir}/proxy.sock", counted)
    finally:
        running.stop()


def run_counted(proxy: CountedProxy, policy: str, options: list[str], label: str) -> dict[str, Any]:
    """`trajproxy run` of the example task by the minimal agent, answered by `policy` with `options` (KEY=VALUE),
    against the counted trajproxy; the task's line of the results."""
    results = Path(proxy.socket).with_name("results.jsonl")
    command = [*RUN, str(EXAMPLE / "tasks.jsonl"), "--agent", "minimal", "--policy", policy]
    for option in options:
        command += ["--policy-option", option]
    command += ["--proxy-url", proxy.url, "--trainer-token", proxy.token, "--socket-source", proxy.socket]
    done = subprocess.run(
        [*command, "--label", label, "--results", str(results)], capture_output=True, text=True, timeout=500
    )
    assert done.returncode == 0, done.stderr
    [line] = [json.loads(text) for text in results.read_text().splitlines()]
    return dict(line)


def assert_none_per_turn(counted: Counted, answered_by: Callable[[], set[str | None]], policy: str) -> None:
    turns = len(counted.agent_calls())
    asked = counted.trainer_api()
    assert turns >= 10, counted.paths  # enough calls that a round trip per call would show
    assert [path for path in asked if path.startswith("/api/turns")] == [], asked
    assert len(asked) <= PER_EPISODE, f"{len(asked)} trainer API requests for {turns} calls: {asked}"
    assert answered_by() == {policy}


def test_a_run_with_a_model_policy_asks_the_trainer_api_nothing_per_turn(
    counted_proxy: CountedProxy,
    fake_model: FakeModel,
    task_image: str,
    engine: Any,
    label: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fake model answers with no command, so the minimal agent asks again, call after call, to its limit."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-fake")  # for litellm, in the trajproxy this test serves
    options = [f"api_base={fake_model.url}/v1", "max_retries=0"]
    line = run_counted(counted_proxy, "model:openai/fake-teacher", options, label)
    assert line["status"] == "failed" and "within 30 turns" in line["reason"], line  # the agent's limit
    assert len(fake_model.seen) == len(counted_proxy.counted.agent_calls())  # each call went to the model once
    database = tmp_path / "counted.db"
    assert_none_per_turn(counted_proxy.counted, lambda: answerers(database), "model:openai/fake-teacher")
    assert not engine.containers.list(all=True, filters={"label": label})


@pytest.mark.timeout(600)  # the first test using vllm waits for it to start
def test_a_run_with_a_served_policy_asks_the_trainer_api_nothing_per_turn(
    counted_proxy: CountedProxy, vllm: Any, task_image: str, engine: Any, label: str, tmp_path: Path
) -> None:
    """The served policy is made to sample a harmless command each call, so the minimal agent runs to its limit."""
    forced = r"```bash\ntrue\n```"
    options = [f"api_base={vllm.base_url}", "temperature=1.0", "seed=3", "max_tokens=16"]
    options.append("structured_outputs=" + json.dumps({"regex": forced}))
    policy = f"vllm:{vllm.served_name}"
    line = run_counted(counted_proxy, policy, options, label)
    assert line["status"] == "failed" and "within 30 turns" in line["reason"], line
    assert_none_per_turn(counted_proxy.counted, lambda: answerers(tmp_path / "counted.db"), policy)
    assert not engine.containers.list(all=True, filters={"label": label})


def answerers(database: Path) -> set[str | None]:
    with sqlite3.connect(database) as db:
        return {by for (by,) in db.execute("SELECT answered_by FROM turn")}
