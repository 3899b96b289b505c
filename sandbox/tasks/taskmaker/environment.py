"""A made task's image: the project installed with its test dependencies, then its bug, in one git commit. The base
image (the project as it is) shares every layer but the last ones with each task's, so Docker's cache builds a
task's image in seconds; the base runs the baseline and the screening of candidate bugs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from sandbox.tasks.taskmaker.project import Project

PYTHON_IMAGE = "python:3.12-slim"
TOOLS = ("pytest>=8,<10", "pytest-cov>=5,<8", "coverage>=7.5,<8", "ruff==0.8.6")  # the verifier's, in every image
WORKDIR = "/app"
BUG = "bug"  # the task's context holds the files the bug changed here, laid over the project's


def dockerfile(project: Project, *, with_bug: bool) -> str:
    requirements = " ".join(json.dumps(item) for item in (*TOOLS, *project.test_requirements))
    lines = [
        f"FROM {PYTHON_IMAGE}",
        "RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*",
        f"RUN pip install --no-cache-dir --disable-pip-version-check {requirements}",
        f"COPY project/ {WORKDIR}/",
        f"WORKDIR {WORKDIR}",
        "ENV PYTHONDONTWRITEBYTECODE=1",
    ]
    if project.installable:
        lines.append("RUN pip install --no-cache-dir --disable-pip-version-check -e .")
    else:
        lines.append(f"ENV PYTHONPATH={WORKDIR}")
    if with_bug:
        lines.append(f"COPY {BUG}/ {WORKDIR}/")
    # One commit, the bug in it: the agent's `git diff` shows its own work and nothing of how the bug was made.
    lines.append(
        "RUN git init -q && git add -A && git -c user.name=trajproxy -c user.email=tasks@trajproxy.invalid "
        "commit -qm 'the project'"
    )
    return "\n".join(lines) + "\n"


def write_context(project: Project, folder: Path, bug: dict[str, bytes] | None = None) -> Path:
    """A build context in `folder`: the project, its Dockerfile and, for a task, the files its bug changed."""
    folder.mkdir(parents=True)
    shutil.copytree(project.root, folder / "project", symlinks=True)
    for path, content in (bug or {}).items():
        target = folder / BUG / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    (folder / "Dockerfile").write_text(dockerfile(project, with_bug=bug is not None), encoding="utf-8")
    return folder
