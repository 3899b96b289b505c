"""A served policy set up as a new user sets it up: a base URL without /v1 is refused when the episode is made,
saying what to give (else every call fails with the server's 404); a conversation that outgrows the model's context
(the server's 400 "maximum context length") reaches the agent as a 400 `context_length_exceeded` saying so, the turn
fails with that reason, and the minimal agent says it in one line, no traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.client import TrainerClient, TrajproxyAPIError
from proxy.schema.requests import served_base_problem
from testkit.tasks import EXAMPLE, ROOT
from tests.test_launch import RUN, into
from tests.test_readme import pages

ON_SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
MINIMAL = ROOT / "agents" / "minimal" / "agent.py"


@ON_SQLITE
@pytest.mark.parametrize("base", ["http://127.0.0.1:8100", "http://127.0.0.1:8100/", "http://127.0.0.1:8100/v1/chat"])
def test_a_served_policy_whose_base_url_does_not_end_in_v1_is_refused_at_once(
    trainer: TrainerClient, base: str
) -> None:
    for kind in ("vllm", "sglang"):
        with pytest.raises(TrajproxyAPIError) as refused:
            trainer.create_episode(policy=f"{kind}:tiny", policy_options={"api_base": base})
        said = refused.value.message
        assert refused.value.status == 422 and "/v1" in said and "\n" not in said, said
    assert trainer.episodes().episodes == []  # nothing was made
    for fine in ("http://127.0.0.1:8100/v1", "http://127.0.0.1:8100/v1/", "https://host/serving/v1"):
        trainer.create_episode(policy="vllm:tiny", policy_options={"api_base": fine})


def test_every_served_example_in_the_readme_and_the_docs_has_its_v1_and_a_max_tokens() -> None:
    text = "\n\n".join(page.read_text() for page in pages())
    bases = re.findall(r'api_base(?:=|": ")(http[^\s"`]+)', text)
    assert bases and [base for base in bases if served_base_problem(base)] == []
    runs = re.findall(r"^`?trajproxy run .*--policy (?:vllm|sglang):.*(?:\n(?!\n).*)*", text, re.M)
    assert runs and [run for run in runs if "max_tokens=" not in run] == []


def test_a_run_with_a_base_url_not_ending_in_v1_is_refused_in_one_line(tmp_path: Path) -> None:
    command = [*RUN, str(EXAMPLE / "tasks.jsonl"), "--agent", "minimal", "--policy", "vllm:tiny"]
    command += ["--policy-option", "api_base=http://localhost:8001"]
    done = subprocess.run([*command, *into(tmp_path / "run.db")], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "api_base" in done.stderr and "/v1" in done.stderr and "Traceback" not in done.stderr, done.stderr


@ON_SQLITE
@pytest.mark.timeout(400)  # the first test using vllm waits for it to start
def test_a_conversation_longer_than_the_context_is_a_clear_400_and_one_line_from_the_minimal_agent(
    vllm: Any, trainer: TrainerClient, tmp_path: Path
) -> None:
    options = {"api_base": vllm.base_url, "temperature": 1.0, "max_tokens": 8}
    episode = trainer.create_episode(policy=f"vllm:{vllm.served_name}", policy_options=options)
    task = tmp_path / "task.md"
    task.write_text("Read this and fix the bug. " + "lorem ipsum dolor sit amet " * 1000)  # past 2048 tokens
    env = {**os.environ, "OPENAI_BASE_URL": episode.env["OPENAI_BASE_URL"], "OPENAI_API_KEY": episode.key}
    done = subprocess.run(
        [sys.executable, str(MINIMAL), f"@{task}", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 1, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr  # one line, no traceback
    line = done.stderr.strip()
    assert line.startswith("[agent] the model call failed: 400 context_length_exceeded:"), line
    assert "maximum context length" in line, line
    [turn] = trainer.trajectory(episode.id).turns
    assert turn.status == "failed" and "longer than the policy's context" in (turn.reason or ""), turn.reason

    long_call = [{"role": "user", "content": task.read_text()}]
    with (
        openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client,
        pytest.raises(openai.BadRequestError) as refused,
    ):
        client.chat.completions.create(model="policy", messages=long_call)  # type: ignore[arg-type]
    assert refused.value.status_code == 400 and "context" in refused.value.message


@ON_SQLITE
@pytest.mark.parametrize(
    ("option", "value"), [("on_discontinuity", "maybe"), ("family", "qwen9"), ("on_discontinuity", 1)]
)
def test_a_bad_family_or_on_discontinuity_is_refused_at_once(
    trainer: TrainerClient, option: str, value: object
) -> None:
    with pytest.raises(TrajproxyAPIError) as refused:
        trainer.create_episode(
            policy="vllm:tiny", policy_options={"api_base": "http://127.0.0.1:8100/v1", option: value}
        )
    said = refused.value.message
    assert refused.value.status == 422 and f"policy_options.{option}" in said and "\n" not in said, said
    assert trainer.episodes().episodes == []
    for fine in ("branch", "fail", "rerender"):
        trainer.create_episode(
            policy="vllm:tiny", policy_options={"api_base": "http://127.0.0.1:8100/v1", "on_discontinuity": fine}
        )
    trainer.create_episode(
        policy="vllm:tiny", policy_options={"api_base": "http://127.0.0.1:8100/v1", "family": "glm4.5"}
    )
