"""A task, whatever format it came in: what the agent is asked, in which image, and how its work is graded.

Three formats read into the same Task (`sandbox/tasks/formats/`, read by `sandbox.tasks.read`): slime's JSONL
(`eval_cmd`'s exit code is the reward), Harbor task directories (Terminal-Bench 2; a verifier writes the reward) and
SWE-bench instances (graded by the `swebench` package).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from proxy.core.values import episode_return
from sandbox.backends.interface import ExecResult, Limits, Sandbox

GradingMode = Literal["fresh", "in-place"]
GRADING_MODES: tuple[GradingMode, ...] = ("fresh", "in-place")
FORMATS = ("jsonl", "harbor", "swebench")
OUTPUT_KEPT = 4000  # how much of a command's output a grade keeps


class TaskError(ValueError):
    """A task that cannot be run; the message names the task and what is wrong with it."""


@dataclass(frozen=True, slots=True)
class Grade:
    """A grader's verdict: named rewards ("reward" is the main one), a one-line verdict, and what it saw."""

    rewards: Mapping[str, float]
    verdict: str
    info: Mapping[str, Any] = field(default_factory=dict)

    @property
    def reward(self) -> float:
        """The episode's return, as the store takes it (`episode_return`): "reward" when named so, else the sum of
        the named ones; 0 with none."""
        returned = episode_return(self.rewards)
        return 0.0 if returned is None else returned


class Grader(Protocol):
    """Grades the work in a sandbox that holds it: the agent's own after it stopped (in-place), or a fresh
    container of the task's image with the agent's diff applied (fresh)."""

    async def grade(self, box: Sandbox, timeout_s: float) -> Grade: ...


class Solver(Protocol):
    """A task's own solution, run in place of an agent (`--agent oracle`) to check that a dataset is sound."""

    async def solve(self, box: Sandbox, timeout_s: float) -> ExecResult: ...


@dataclass(frozen=True, slots=True)
class Task:
    prompt: str
    image: str
    workdir: str | None  # None: the image's own working directory
    grader: Grader
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    line: int = 0  # the line of a JSONL file it came from; 0 for a task directory
    id: str = ""  # stable across runs of the same file, so a resumed run knows it (set by its format)
    grading: GradingMode = "fresh"
    build: Path | None = None  # a Docker build context that makes `image`, when it is not there yet
    build_timeout_s: float = 600.0
    solver: Solver | None = None
    limits: Limits | None = None  # the task's own resources; None: the run's
    agent_timeout_s: float | None = None  # the task's own budgets; None: the run's
    grade_timeout_s: float | None = None
    read_only: bool = False  # the agent's root read-only, but for its workdir and scratch (unless the run says)
    scratch: tuple[str, ...] = ()  # folders besides /tmp the format's own tools write in a read-only sandbox
    setup: str = ""  # bash, run in the working directory before the agent, and before a fresh grade applies its diff

    @property
    def where(self) -> str:
        """The task as a person finds it: its own id, else (a JSONL line with none) its line."""
        made_up = not self.id or self.id.startswith(f"line-{self.line}-")
        return f"line {self.line}" if made_up else self.id


def read_only(value: Any, where: str) -> bool:
    """A task's own read_only setting, checked."""
    if not isinstance(value, bool):
        raise TaskError(f"{where} must be true or false, not {value!r}")
    return value


def tail(text: str) -> str:
    """The end of a long output, as much of it as a record keeps."""
    return text if len(text) <= OUTPUT_KEPT else "…" + text[-OUTPUT_KEPT:]
