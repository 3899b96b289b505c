"""Real agent CLIs, unmodified, through trajproxy: each completes a task that needs one tool call, answered by a
scripted trainer over the trainer API; what the agent did and what the database recorded are both checked."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from proxy.client import TrainerClient

CLIS = Path(__file__).parent.parent / "agents" / "cli"
BIN = CLIS / "node_modules" / ".bin"
PY_BIN = CLIS / ".venv" / "bin"
TASK = "Create a file hello.txt containing hi"


def cli(name: str, folder: Path = BIN) -> str:
    path = folder / name
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the agent CLI tests: {path} is missing (.ci/run installs agents/cli)")
        pytest.skip(f"{name} is not installed under agents/cli (bash .ci/run installs it)")
    return str(path)


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/trajproxy.db"


def folders(root: Path, *names: str) -> list[Path]:
    """Fresh folders for an agent: its working directory and a HOME of its own."""
    made = [root / name for name in names]
    for folder in made:
        folder.mkdir()
    return made


def answer_until_exit(
    trainer: TrainerClient, agent: subprocess.Popen[str], policy: Callable[[Any], dict[str, Any]]
) -> list[Any]:
    """The scripted trainer: answer every turn the agent makes with `policy(turn)` until the agent exits."""
    seen: list[Any] = []

    def loop() -> None:
        while agent.poll() is None:
            for turn in trainer.next_turns(max=8, wait_s=0.5):
                seen.append(turn)
                trainer.reply(turn.id, **policy(turn))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    agent.wait(timeout=120)
    thread.join(timeout=10)
    return seen


def one_tool_call(tool: str, arguments: dict[str, Any]) -> Callable[[Any], dict[str, Any]]:
    """Call `tool` once when the agent offers it, then say the task is done."""

    def policy(turn: Any) -> dict[str, Any]:
        names = {(t.get("function") or {}).get("name") for t in turn.request.get("tools") or ()}
        if tool in names and turn.request["messages"][-1]["role"] != "tool":
            return {
                "content": "On it.",
                "tool_calls": [{"id": f"call_{turn.seq}", "function": {"name": tool, "arguments": arguments}}],
            }
        return {"content": "Done: hello.txt created."}

    return policy


def test_claude_code_completes_a_task_with_one_tool_call(server: Any, trainer: TrainerClient, tmp_path: Path) -> None:
    claude = cli("claude")
    episode = trainer.create_episode(task=TASK)
    work, home = folders(tmp_path, "work", "home")
    env = {
        **os.environ,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": episode.env["ANTHROPIC_BASE_URL"],
        "ANTHROPIC_API_KEY": episode.env["ANTHROPIC_API_KEY"],
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    agent = subprocess.Popen(
        [claude, "-p", TASK, "--allowedTools", "Bash", "--output-format", "json"],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen = answer_until_exit(
        trainer, agent, one_tool_call("Bash", {"command": "echo hi > hello.txt", "description": "Create hello.txt"})
    )
    stdout, stderr = agent.communicate()
    assert agent.returncode == 0, stderr[-2000:]
    result = json.loads(stdout)
    assert (result["is_error"], result["result"]) == (False, "Done: hello.txt created.")
    assert (work / "hello.txt").read_text() == "hi\n"

    turns = trainer.trajectory(episode.id).turns
    assert {turn.dialect for turn in turns} == {"anthropic"}
    assert {turn.status for turn in turns} == {"answered"}
    tool_results = [m for turn in seen for m in turn.request["messages"] if m["role"] == "tool"]
    assert tool_results and tool_results[0]["tool_call_id"].startswith("call_")


def test_codex_exec_completes_a_task_with_one_shell_command(
    server: Any, trainer: TrainerClient, tmp_path: Path
) -> None:
    codex = cli("codex")
    episode = trainer.create_episode(task=TASK)
    work, home = folders(tmp_path, "work", "codex-home")
    (home / "config.toml").write_text(
        'model = "policy"\nmodel_provider = "trajproxy"\n\n[model_providers.trajproxy]\nname = "trajproxy"\n'
        f'base_url = "{episode.env["OPENAI_BASE_URL"]}"\nenv_key = "TRAJPROXY_KEY"\nwire_api = "responses"\n'
    )
    env = {**os.environ, "HOME": str(home), "CODEX_HOME": str(home), "TRAJPROXY_KEY": episode.key}
    agent = subprocess.Popen(
        [codex, "exec", "--skip-git-repo-check", "-s", "danger-full-access", TASK],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen = answer_until_exit(trainer, agent, one_tool_call("exec_command", {"cmd": "echo hi > hello.txt"}))
    stdout, stderr = agent.communicate()
    assert agent.returncode == 0, stderr[-2000:]
    assert "Done: hello.txt created." in stdout
    assert (work / "hello.txt").read_text() == "hi\n"

    turns = trainer.trajectory(episode.id).turns
    assert {turn.dialect for turn in turns} == {"responses"}
    assert {turn.status for turn in turns} == {"answered"}
    assert any(
        m["role"] == "tool" and "exited with code 0" in str(m["content"]) for t in seen for m in t.request["messages"]
    )


def test_mini_swe_agent_completes_a_task_with_its_default_tool_calling_config(
    server: Any, trainer: TrainerClient, tmp_path: Path
) -> None:
    mini = cli("mini", PY_BIN)
    episode = trainer.create_episode(task=TASK)
    work, home = folders(tmp_path, "work", "home")
    env = {
        **os.environ,
        "HOME": str(home),
        "OPENAI_API_BASE": episode.env["OPENAI_BASE_URL"],
        "OPENAI_API_KEY": episode.key,
        "MSWEA_CONFIGURED": "true",
        "MSWEA_COST_TRACKING": "ignore_errors",  # the policy has no price in litellm's tables
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    commands = iter(["echo hi > hello.txt", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"])

    def policy(turn: Any) -> dict[str, Any]:
        call = {"id": f"call_{turn.seq}", "function": {"name": "bash", "arguments": {"command": next(commands)}}}
        return {"content": "Running it.", "tool_calls": [call]}

    trajectory = tmp_path / "trajectory.json"
    options = ["--yolo", "--cost-limit", "0", "--exit-immediately", "-o", str(trajectory)]
    agent = subprocess.Popen(
        [mini, "-m", "openai/policy", "-t", TASK, *options],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    seen = answer_until_exit(trainer, agent, policy)
    _, stderr = agent.communicate()
    assert agent.returncode == 0, stderr[-2000:]
    assert (work / "hello.txt").read_text() == "hi\n"
    assert json.loads(trajectory.read_text())["info"]["exit_status"] == "Submitted"

    assert [tool["function"]["name"] for tool in seen[0].request["tools"]] == ["bash"]  # its default: tool calling
    turns = trainer.trajectory(episode.id).turns
    assert [(turn.dialect, turn.status) for turn in turns] == [("chat", "answered")] * 2
    assert turns[1].request["messages"][-1]["role"] == "tool"
