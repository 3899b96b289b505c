"""Tasks in slime's JSONL shape: `prompt`, `label`, and `metadata` with `image`, `workdir` and `eval_cmd`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TaskError(ValueError):
    """A task line that cannot be run; the message names the line and what is wrong with it."""


@dataclass(frozen=True, slots=True)
class Task:
    prompt: str
    image: str
    workdir: str
    eval_cmd: str
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    line: int = 0

    @classmethod
    def parse(cls, data: Any, *, line: int = 0, image: str | None = None) -> Task:
        """A task from one decoded JSONL object; `image` overrides the task's own (e.g. `--image`)."""
        where = f"task on line {line}" if line else "task"
        if not isinstance(data, dict):
            raise TaskError(f"{where}: expected a JSON object, got {type(data).__name__}")
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise TaskError(f"{where}: 'metadata' must be an object")
        prompt = metadata.get("problem_statement") or data.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise TaskError(f"{where}: needs a 'prompt' (or metadata.problem_statement)")
        eval_cmd = metadata.get("eval_cmd")
        if not isinstance(eval_cmd, str) or not eval_cmd.strip():
            raise TaskError(f"{where}: needs metadata.eval_cmd, the command whose exit code grades the work")
        image = image or metadata.get("image")
        if not isinstance(image, str) or not image:
            raise TaskError(f"{where}: needs metadata.image (or pass --image)")
        workdir = metadata.get("workdir") or "/"
        return cls(prompt, image, str(workdir), eval_cmd, data.get("label"), metadata, line)


def read_tasks(path: str | Path, *, image: str | None = None) -> Iterator[Task | TaskError]:
    """Every line of a JSONL file as a Task, or as the TaskError that says why it cannot run."""
    with open(path, encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                yield Task.parse(json.loads(text), line=number, image=image)
            except json.JSONDecodeError as e:
                yield TaskError(f"task on line {number}: not valid JSON ({e.msg} at column {e.colno})")
            except TaskError as e:
                yield e
