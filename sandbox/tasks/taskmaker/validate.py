"""Every made task, run as users run it: `trajproxy run DIR --agent oracle` must score 1.0 and an agent that changes
nothing (`--agent-cmd true`) 0; a task that fails either is dropped, and said why."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AGENTS = {"oracle": ["--agent", "oracle"], "no-op": ["--agent-cmd", "true"]}
EXPECTED = {"oracle": 1.0, "no-op": 0.0}


@dataclass(frozen=True, slots=True)
class Checked:
    rewards: dict[str, dict[str, float | None]]  # agent -> task id -> reward (None: it did not finish)
    reasons: dict[str, dict[str, str]]  # agent -> task id -> the run's reason

    def failures(self, task: str) -> list[str]:
        said = []
        for agent, expected in EXPECTED.items():
            reward = self.rewards[agent].get(task)
            if reward != expected:
                reason = self.reasons[agent].get(task, "it did not run")
                said.append(f"{agent} scored {reward} (expected {expected:g}): {reason}")
        return said


def validate(folder: Path, concurrency: int, timeout_s: float) -> Checked:
    rewards: dict[str, dict[str, float | None]] = {}
    reasons: dict[str, dict[str, str]] = {}
    for agent, options in AGENTS.items():
        rows = run_tasks(folder, options, concurrency, timeout_s)
        rewards[agent] = {row["task_id"]: row["reward"] for row in rows}
        reasons[agent] = {row["task_id"]: str(row["reason"]) for row in rows}
    return Checked(rewards, reasons)


def run_tasks(folder: Path, options: list[str], concurrency: int, timeout_s: float) -> list[dict[str, Any]]:
    """`trajproxy run FOLDER OPTIONS` in a process of its own, with its own database and port: its results' lines."""
    with tempfile.TemporaryDirectory(prefix="trajproxy-validate-") as scratch:
        results = Path(scratch) / "results.jsonl"
        command = [
            *trajproxy(),
            "run",
            str(folder),
            *options,
            "--results",
            str(results),
            "--database-url",
            f"sqlite:///{scratch}/trajproxy.db",
            "--port",
            str(free_port()),
            "--concurrency",
            str(concurrency),
            "--label",
            "trajproxy-tasks-make=validate",
        ]
        subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
        if not results.is_file():
            return []
        return [json.loads(line) for line in results.read_text().splitlines() if line.strip()]


def trajproxy() -> list[str]:
    """The trajproxy command line of this Python."""
    return [sys.executable, "-c", "from proxy.cli.main import main; main()"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
