#!/usr/bin/env python3
"""A minimal coding agent: it asks the model for one bash command at a time, runs it, and shows it the output.

It knows nothing of trajproxy: like most agents, it reads OPENAI_BASE_URL and OPENAI_API_KEY and calls
the Chat Completions API. It stops when the model runs `echo TASK_COMPLETE`, or after --max-turns.

    minimal-agent "Make the failing test pass." --workdir /repo
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from openai import APIError, APIStatusError, OpenAI

DONE = "TASK_COMPLETE"
SYSTEM = f"""You are an autonomous coding agent working in the repository at {{workdir}}.
Reply with your reasoning and exactly one bash command in a ```bash code block; you will be shown its
exit code and output. Work step by step: look around, make the change, check it.
When the task is complete, reply with a ```bash block that contains only: echo {DONE}"""
COMMAND = re.compile(r"```(?:bash|sh)\s*\n(.*?)```", re.DOTALL)
MAX_OUTPUT_CHARS = 10_000


def first_command(text: str) -> str | None:
    match = COMMAND.search(text)
    return match.group(1).strip() if match else None


def run(command: str, workdir: str, timeout_s: float) -> str:
    try:
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=workdir,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return f"(the command timed out after {timeout_s:g} s)"
    output = done.stdout + done.stderr
    if len(output) > MAX_OUTPUT_CHARS:
        cut = len(output) - MAX_OUTPUT_CHARS
        output = f"{output[: MAX_OUTPUT_CHARS // 2]}\n… ({cut} characters cut) …\n{output[-MAX_OUTPUT_CHARS // 2 :]}"
    return f"exit code {done.returncode}\n{output}"


def solve(client: OpenAI, task: str, *, model: str, workdir: str, max_turns: int, timeout_s: float) -> bool:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM.format(workdir=workdir)},
        {"role": "user", "content": task},
    ]
    for turn in range(1, max_turns + 1):
        reply = client.chat.completions.create(model=model, messages=messages).choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        command = first_command(reply)
        if command is None:
            messages.append({"role": "user", "content": "Reply with exactly one ```bash code block."})
            continue
        if command == f"echo {DONE}":
            print(f"[agent] done after {turn} turns", file=sys.stderr)
            return True
        print(f"[agent] $ {command}", file=sys.stderr)
        messages.append({"role": "user", "content": run(command, workdir, timeout_s)})
    print(f"[agent] stopped: no {DONE} within {max_turns} turns", file=sys.stderr)
    return False


def failure(error: APIError) -> str:
    """What a failed model call says, on one line: its status, kind and message (the server's own words)."""
    said = error.message  # no answer came (APIConnectionError, APITimeoutError): what the SDK says of it
    if isinstance(error, APIStatusError):
        detail = error.body if isinstance(error.body, dict) else {}  # the SDK keeps the body's `error` object
        said = f"{error.status_code} {detail.get('type') or 'error'}: {detail.get('message') or error.message}"
    return " ".join(said.split())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", help="the task, as text (or @FILE to read it from a file)")
    parser.add_argument("--workdir", default=os.getcwd())
    parser.add_argument("--model", default=os.environ.get("MINIMAL_AGENT_MODEL", "policy"))
    parser.add_argument("--max-turns", type=int, default=30)
    parser.add_argument("--command-timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    task = Path(args.task[1:]).read_text() if args.task.startswith("@") else args.task
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    try:
        solved = solve(
            client,
            task,
            model=args.model,
            workdir=args.workdir,
            max_turns=args.max_turns,
            timeout_s=args.command_timeout_s,
        )
    except APIError as e:  # the model's failure is the run's to report: one line, not the SDK's traceback
        print(f"[agent] the model call failed: {failure(e)}", file=sys.stderr)
        return 1
    return 0 if solved else 1


if __name__ == "__main__":
    sys.exit(main())
