"""Reading tasks: `read_tasks` tells the formats apart by what the path is, or by the format it is given."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from sandbox.tasks.formats import harbor, jsonl, swebench
from sandbox.tasks.task import FORMATS, Task, TaskError


def read_tasks(
    path: str | Path,
    *,
    image: str | None = None,
    image_template: str | None = None,
    format: str | None = None,
) -> Iterator[Task | TaskError]:
    """Every task at `path` as a Task, or as the TaskError that says why it cannot run. A directory is Harbor
    tasks; a file of JSONL objects with `instance_id` and `base_commit` is SWE-bench; other JSONL is slime's."""
    path = Path(path)
    chosen = format or _format_of(path)
    if chosen == "harbor":
        yield from harbor.read(path, image=image)
    elif chosen == "swebench":
        yield from swebench.read(path, image=image, image_template=image_template)
    elif chosen == "jsonl":
        yield from jsonl.read(path, image=image)
    else:
        raise TaskError(f"unknown task format {chosen!r}: use one of {', '.join(FORMATS)}")


def _format_of(path: Path) -> str:
    if path.is_dir():
        return "harbor"
    return "swebench" if swebench.looks_like(path) else "jsonl"
