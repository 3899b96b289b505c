"""Each preset's task on a bare image: the image (no Python, no Node, a non-root user) and an older Debian's, the
task whose tests are a shell script, and what a policy trained on each preset's dialect and tools would answer
(tests/test_injection.py's conformance, benchmarks/agents.py's timings)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

BARE = "trajproxy-test/bare-task"  # python:3.11-slim with Python and Node removed, a non-root user
OLD = "trajproxy-test/old-task"  # debian:bullseye-slim (no Python, no Node), a non-root user
OLD_BASE = "debian:bullseye-slim"
TASK = "Create a file hello.txt in /repo containing hi (the tests are `sh test.sh`)."
# The task's own modules, on its PYTHONPATH and in the working directory, named like the Python agents' packages:
# an agent that let them shadow its own would die on import.
REPO_SETUP = """
ENV PYTHONPATH=/repo
RUN mkdir -p /repo && cd /repo \\
 && printf '#!/bin/sh\\ntest "$(cat hello.txt)" = hi\\n' > test.sh \\
 && for m in openai litellm minisweagent; do echo 'raise SystemExit("the task shadowed the agent")' > $m.py; done \\
 && git init -q && git add -A \\
 && git -c user.email=t@example.com -c user.name=t commit -qm "a task whose test fails" \\
 && chown -R {user} /repo
USER {user}
WORKDIR /repo
"""
BARE_DOCKERFILE = f"""FROM python:3.11-slim
RUN rm -rf /usr/bin/python3* /usr/lib/python3* /usr/local/lib/python3* /usr/local/bin/python* /usr/bin/node \\
 && ! command -v python3 && ! command -v node
{REPO_SETUP.format(user="1234:1234")}"""
OLD_DOCKERFILE = f"""FROM {OLD_BASE}
RUN ! command -v python3 && ! command -v node
{REPO_SETUP.format(user="1234:1234")}"""


def bash_tool(
    tool: str, done: str | None = None, shape: Callable[[str], dict[str, Any]] | None = None, **extra: Any
) -> Callable[[Any], dict[str, Any]]:
    """Call `tool` to write hello.txt, then (with `done`) run the agent's own finishing command, then say done; a
    command goes in the tool's arguments as `shape` makes them (default: {"command": ..., **extra})."""
    commands = ["echo hi > hello.txt", *([done] if done else [])]

    def policy(turn: Any) -> dict[str, Any]:
        ran = sum(message["role"] == "tool" for message in turn.request["messages"])
        if ran < len(commands):
            arguments = shape(commands[ran]) if shape else {"command": commands[ran], **extra}
            call = {"id": f"call_{turn.seq}", "function": {"name": tool, "arguments": arguments}}
            return {"content": "On it.", "tool_calls": [call]}
        return {"content": "Done: hello.txt holds hi."}

    return policy


def text_commands(turn: Any) -> dict[str, Any]:
    said = sum(message["role"] == "assistant" for message in turn.request["messages"])
    return {"content": ["```bash\necho hi > hello.txt\n```", "```bash\necho TASK_COMPLETE\n```"][min(said, 1)]}


def tool_then_finish(tool: str, finish: str, **extra: Any) -> Callable[[Any], dict[str, Any]]:
    """Call `tool` to write hello.txt, then the agent's own `finish` tool (its way of saying it is done)."""
    calls = [(tool, {"command": "echo hi > hello.txt", **extra}), (finish, {"message": "hello.txt holds hi.", **extra})]

    def policy(turn: Any) -> dict[str, Any]:
        name, arguments = calls[min(sum(message["role"] == "tool" for message in turn.request["messages"]), 1)]
        return {
            "content": "On it.",
            "tool_calls": [{"id": f"call_{turn.seq}", "function": {"name": name, "arguments": arguments}}],
        }

    return policy


# Each preset's own dialect and tool: what a policy trained on it would answer.
PRESETS: dict[str, tuple[str, Callable[[Any], dict[str, Any]]]] = {
    "minimal": ("chat", text_commands),
    "codex": ("responses", bash_tool("exec_command", shape=lambda command: {"cmd": command})),
    "claude-code": ("anthropic", bash_tool("Bash", description="Create hello.txt")),
    "mini-swe-agent": ("chat", bash_tool("bash", done="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")),
    "gemini-cli": ("gemini", bash_tool("run_shell_command")),
    "qwen-code": ("chat", bash_tool("run_shell_command", is_background=False)),
    "openhands": ("chat", tool_then_finish("terminal", "finish", security_risk="LOW")),
    "opencode": ("chat", bash_tool("bash", description="Create hello.txt")),
    "aider": ("chat", lambda turn: {"content": "hello.txt\n```\nhi\n```"}),
    "kilocode": ("chat", bash_tool("bash", description="Create hello.txt")),
    "cline": ("chat", bash_tool("run_commands", shape=lambda command: {"commands": [command]})),
    "gptme": ("chat", tool_then_finish("shell", "complete")),
    "pi": ("chat", bash_tool("bash")),
    "continue-cli": ("chat", bash_tool("Bash")),
}
