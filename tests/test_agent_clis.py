"""Real agent CLIs, unmodified, through trajproxy: each completes a task in three calls (two tool calls, then the
answer), answered by a scripted trainer over the trainer API. What the agent did and what was recorded are both
checked, and the recording is what a trainer can train on: one branch whose turns each extend the one before, with
every message in the role the agent sent it in. Claude Code's sub-agent runs on a branch of its own, and the export
splits the episode's reward over both."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from proxy.client import TrainerClient
from sandbox.agents.manifests import load
from tests.test_export import lines_of

CLIS = Path(__file__).parent.parent / "agents" / "cli"
BIN = CLIS / "node_modules" / ".bin"
PY_BIN = CLIS / ".venv" / "bin"
TASK = "Create a file hello.txt containing hi, then a file bye.txt containing bye"


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


def run_answered(
    trainer: TrainerClient,
    command: list[str],
    work: Path,
    env: dict[str, str],
    policy: Callable[[Any], dict[str, Any]],
    **popen: Any,
) -> tuple[list[Any], str]:
    """Run an agent's CLI in `work`, answered by `policy` until it exits, which it must with 0: the turns it made,
    and what it printed on stdout."""
    agent = subprocess.Popen(
        command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )
    seen = answer_until_exit(trainer, agent, policy)
    stdout, stderr = agent.communicate()
    assert agent.returncode == 0, stderr[-2000:]
    return seen, stdout


def tool_calls(tool: str, *arguments: dict[str, Any]) -> Callable[[Any], dict[str, Any]]:
    """Call `tool` with each of `arguments` in turn when the agent offers it, then say the task is done. Which call
    comes next is read from the conversation (the tool results in it), so a retried call gets the same answer."""

    def policy(turn: Any) -> dict[str, Any]:
        names = {(t.get("function") or {}).get("name") for t in turn.request.get("tools") or ()}
        done = sum(message["role"] == "tool" for message in turn.request["messages"])
        if tool in names and done < len(arguments):
            call = {"id": f"call_{turn.seq}", "function": {"name": tool, "arguments": arguments[done]}}
            return {"content": "On it.", "tool_calls": [call]}
        return {"content": "Done: hello.txt and bye.txt created."}

    return policy


def sent_roles(dialect: str, wire: dict[str, Any]) -> list[str]:
    """The roles of the messages an agent sent, in order, read from its request as it came over the wire: what
    the trainer must see. A tool result is a `tool` message in chat shape, whatever carried it."""
    if dialect == "chat":
        return [message["role"] for message in wire["messages"]]
    roles: list[str] = []
    if dialect == "gemini":
        roles += ["system"] if wire.get("systemInstruction") else []
        for content in wire["contents"]:
            results = [part for part in content["parts"] if "functionResponse" in part]
            role = {"model": "assistant"}.get(content.get("role"), "user")
            roles += ["tool"] * len(results) + ([role] if len(results) < len(content["parts"]) else [])
        return roles
    if dialect == "anthropic":
        roles += ["system"] if wire.get("system") else []
        for message in wire["messages"]:
            blocks = message["content"] if isinstance(message["content"], list) else [message["content"]]
            results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
            roles += ["tool"] * len(results) + ([message["role"]] if len(results) < len(blocks) else [])
        return roles
    roles += ["system"] if wire.get("instructions") else []
    for item in wire["input"]:
        kind = item.get("type", "message")
        implied = {"function_call_output": "tool", "function_call": "assistant", "reasoning": "assistant"}.get(kind)
        if implied == "assistant" and roles[-1:] == ["assistant"]:
            continue  # a call or reasoning joins the assistant message it follows, as in chat shape
        roles.append(implied or item["role"])
    return roles


def assert_trainable(turns: list[Any], dialect: str, calls: int = 3) -> None:
    """One branch, each turn extending the one before, every message in the role the agent sent it in."""
    assert [(turn.dialect, turn.status, turn.trainable) for turn in turns] == [(dialect, "answered", True)] * calls
    assert {turn.branch for turn in turns} == {0}
    assert [turn.parent_id for turn in turns] == [None, *(turn.id for turn in turns[:-1])]
    for turn in turns:
        assert [message["role"] for message in turn.request["messages"]] == sent_roles(
            dialect, turn.wire or turn.request
        ), turn.seq


def claude_env(episode: Any, home: Path) -> dict[str, str]:
    """Claude Code's environment for an episode: trajproxy as its API, a HOME of its own, no traffic elsewhere."""
    return {
        **os.environ,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": episode.env["ANTHROPIC_BASE_URL"],
        "ANTHROPIC_API_KEY": episode.env["ANTHROPIC_API_KEY"],
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }


def test_claude_code_completes_a_task_in_three_calls_recorded_as_one_branch(
    server: Any, trainer: TrainerClient, tmp_path: Path
) -> None:
    claude = cli("claude")
    episode = trainer.create_episode(task=TASK)
    work, home = folders(tmp_path, "work", "home")
    env = claude_env(episode, home)
    policy = tool_calls(
        "Bash",
        {"command": "echo hi > hello.txt", "description": "Create hello.txt"},
        {"command": "echo bye > bye.txt", "description": "Create bye.txt"},
    )
    command = [claude, "-p", TASK, "--allowedTools", "Bash", "--output-format", "json"]
    seen, stdout = run_answered(trainer, command, work, env, policy)
    result = json.loads(stdout)
    assert (result["is_error"], result["result"]) == (False, "Done: hello.txt and bye.txt created.")
    assert ((work / "hello.txt").read_text(), (work / "bye.txt").read_text()) == ("hi\n", "bye\n")

    turns = trainer.trajectory(episode.id).turns
    assert_trainable(turns, "anthropic")
    # Claude Code's instructions include a `system` message inside the conversation, as blocks on its first call
    # and as a string after: it stays a system message, and the conversation stays one branch.
    assert "system" in [message["role"] for message in seen[0].request["messages"][1:]]
    tool_results = [m for turn in seen for m in turn.request["messages"] if m["role"] == "tool"]
    assert tool_results and tool_results[0]["tool_call_id"].startswith("call_")


def test_codex_exec_completes_a_task_in_three_calls_recorded_as_one_branch(
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
    policy = tool_calls("exec_command", {"cmd": "echo hi > hello.txt"}, {"cmd": "echo bye > bye.txt"})
    command = [codex, "exec", "--skip-git-repo-check", "-s", "danger-full-access", TASK]
    seen, stdout = run_answered(trainer, command, work, env, policy)
    assert "Done: hello.txt and bye.txt created." in stdout
    assert ((work / "hello.txt").read_text(), (work / "bye.txt").read_text()) == ("hi\n", "bye\n")

    turns = trainer.trajectory(episode.id).turns
    assert_trainable(turns, "responses")
    assert any(
        m["role"] == "tool" and "exited with code 0" in str(m["content"]) for t in seen for m in t.request["messages"]
    )


def test_mini_swe_agent_completes_a_task_in_three_calls_with_its_default_tool_calling_config(
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
    commands = iter(["echo hi > hello.txt", "echo bye > bye.txt", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"])

    def policy(turn: Any) -> dict[str, Any]:
        call = {"id": f"call_{turn.seq}", "function": {"name": "bash", "arguments": {"command": next(commands)}}}
        return {"content": "Running it.", "tool_calls": [call]}

    trajectory = tmp_path / "trajectory.json"
    options = ["--yolo", "--cost-limit", "0", "--exit-immediately", "-o", str(trajectory)]
    command = [mini, "-m", "openai/policy", "-t", TASK, *options]
    seen, _ = run_answered(trainer, command, work, env, policy, stdin=subprocess.DEVNULL)
    assert ((work / "hello.txt").read_text(), (work / "bye.txt").read_text()) == ("hi\n", "bye\n")
    assert json.loads(trajectory.read_text())["info"]["exit_status"] == "Submitted"

    assert [tool["function"]["name"] for tool in seen[0].request["tools"]] == ["bash"]  # its default: tool calling
    turns = trainer.trajectory(episode.id).turns
    assert_trainable(turns, "chat")
    assert [turn.request["messages"][-1]["role"] for turn in turns] == ["user", "tool", "tool"]


@pytest.mark.settings(keepalive_s=0.05)
def test_gemini_cli_completes_a_task_in_three_calls_recorded_as_one_branch(
    server: Any, trainer: TrainerClient, tmp_path: Path
) -> None:
    """Configured as its preset configures it (agents/gemini-cli.toml: env and settings file), on the host's Node;
    each answer comes after its stream has carried keep-alives."""
    gemini = cli("gemini")
    episode = trainer.create_episode(task=TASK)
    work, home = folders(tmp_path, "work", "home")
    values = {"home": str(home), "api_key": episode.key, "gemini_base_url": episode.env["GOOGLE_GEMINI_BASE_URL"]}
    preset = load("gemini-cli").render({**values, "task": TASK, "model": "policy", "bundle": "", "workdir": str(work)})
    for file in preset.files:
        Path(file.path).parent.mkdir(parents=True, exist_ok=True)
        Path(file.path).write_text(file.content)
    policy = tool_calls("run_shell_command", {"command": "echo hi > hello.txt"}, {"command": "echo bye > bye.txt"})
    command = [gemini, "-p", TASK, "-m", "policy", "--yolo", "--output-format", "json"]
    env = {**os.environ, **preset.env}

    def slowly(turn: Any) -> dict[str, Any]:
        time.sleep(0.2)
        return policy(turn)

    seen, stdout = run_answered(trainer, command, work, env, slowly)
    assert json.loads(stdout)["response"] == "Done: hello.txt and bye.txt created."
    assert ((work / "hello.txt").read_text(), (work / "bye.txt").read_text()) == ("hi\n", "bye\n")

    turns = trainer.trajectory(episode.id).turns
    assert_trainable(turns, "gemini")
    assert [message["role"] for message in turns[-1].request["messages"]] == [
        "system", "user", "assistant", "tool", "assistant", "tool"
    ]  # fmt: skip
    assistant, tool = turns[1].request["messages"][2:4]
    assert assistant["tool_calls"][0]["function"]["name"] == "run_shell_command"
    assert tool["tool_call_id"] == assistant["tool_calls"][0]["id"] == f"call_{seen[0].seq}"


def test_a_claude_code_episode_with_a_sub_agent_splits_its_reward_over_its_two_branches(
    server: Any, trainer: TrainerClient, tmp_path: Path
) -> None:
    """Claude Code hands the work to a sub-agent (its Agent tool), which runs in a conversation of its own: a second
    branch. With token ids on every reply (each branch's prompt extending what came before on it), both shapes
    write one line per branch, each with half the reward and the episode's one rollout_id."""
    claude = cli("claude")
    episode = trainer.create_episode(task="Create hello.txt containing hi")
    work, home = folders(tmp_path, "work", "home")
    env = claude_env(episode, home)
    sequences: dict[int, list[int]] = {}  # each branch's token ids so far, as a served policy would have them

    def policy(turn: Any) -> dict[str, Any]:
        results = sum(message["role"] == "tool" for message in turn.request["messages"])
        if turn.branch == 0:  # the main agent: hand the task over and wait for it, then say done
            arguments: dict[str, object] = {
                "description": "Create hello.txt",
                "prompt": "Create hello.txt containing hi",
            }
            arguments |= {"subagent_type": "general-purpose", "run_in_background": False}
            call = {"id": f"call_{turn.seq}", "function": {"name": "Agent", "arguments": arguments}}
            message = {"content": "Handing it over.", "tool_calls": [call]} if not results else {"content": "Done."}
        elif not results:  # the sub-agent: do it, then report
            arguments = {"command": "echo hi > hello.txt", "description": "Create hello.txt"}
            message = {
                "content": "On it.",
                "tool_calls": [{"id": f"call_{turn.seq}", "function": {"name": "Bash", "arguments": arguments}}],
            }
        else:
            message = {"content": "hello.txt holds hi."}
        prompt = [*sequences.get(turn.branch, []), 1000 + turn.seq]
        completion = [2000 + turn.seq, 3000 + turn.seq]
        sequences[turn.branch] = prompt + completion
        return {
            "message": message,
            "prompt_token_ids": prompt,
            "completion_token_ids": completion,
            "logprobs": [-0.5, -0.5],
        }

    command = [
        claude,
        "-p",
        "Create hello.txt containing hi",
        "--allowedTools",
        "Bash Agent",
        "--output-format",
        "json",
    ]
    run_answered(trainer, command, work, env, policy)
    assert (work / "hello.txt").read_text() == "hi\n"
    turns = trainer.trajectory(episode.id).turns
    # the main conversation, the sub-agent's two calls, the main one's last: its reply seeing the sub-agent's report
    assert [turn.branch for turn in turns] == [0, 1, 1, 0] and turns[3].parent_id == turns[0].id
    trainer.add_reward(episode.id, 1.0, source="grader")
    trainer.finish(episode.id)

    url = server.settings.database_url  # sqlite: the agent CLIs' tests run on one store
    for shape in ("chat", "tokens"):
        lines = lines_of(url, tmp_path, "--shape", shape, "--split-reward")
        assert [(line["branch"], line["reward"], line["reward_split_over"]) for line in lines] == [
            (0, 0.5, 2),
            (1, 0.5, 2),
        ]
        assert len({line["rollout_id"] for line in lines}) == 1
        if shape == "tokens":  # each branch one sequence, its two calls' sampled ids under loss
            assert [line["loss_mask"] for line in lines] == [[1, 1, 0, 1, 1], [1, 1, 0, 1, 1]]
