"""A made task's image: what the project declares it needs, installed with the network, then the project itself with
none (`RUN --network=none`), then its bug, in one git commit. The base image (the project as it is) shares every
layer but the last ones with each task's, so Docker's cache builds a task's image in seconds; the base runs the
baseline and the screening of candidate bugs."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from sandbox.tasks.taskmaker.project import Project

PYTHON_IMAGE = "python:3.12-slim"
TOOLS = ("pytest>=8,<10", "pytest-cov>=5,<8", "coverage>=7.5,<8", "ruff==0.8.6")  # the verifier's, in every image
WORKDIR = "/app"
PIP = "pip install --no-cache-dir --disable-pip-version-check"
# A dependency the project declares only where running it would find it (a computed install_requires) is missing
# once it is installed with no network: said in one line rather than as tests that cannot import.
CHECK = (
    "{ pip check | grep 'which is not installed' >/tmp/missing || true; } && if [ -s /tmp/missing ]; then "
    'echo "ERROR: $(head -n 1 /tmp/missing) (declared where only running its code finds it)"; exit 1; fi'
)
BUG = "bug"  # the task's context holds the files the bug changed here, laid over the project's


def dockerfile(project: Project, *, with_bug: bool) -> str:
    needed = (*TOOLS, *project.build_requirements, *project.dependencies, *project.test_requirements)
    lines = [
        f"FROM {PYTHON_IMAGE}",
        "RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*",
        # What the project declares it needs, read from its files: the last step with the network.
        f"RUN {PIP} {' '.join(shlex.quote(item) for item in needed)}",
        f"COPY project/ {WORKDIR}/",
        f"WORKDIR {WORKDIR}",
        "ENV PYTHONDONTWRITEBYTECODE=1",
    ]
    # From here on the project's own code runs (its setup.py, its build backend's hooks, a .pth file it installs):
    # every step has no network.
    if project.installable:
        lines.append(f"RUN --network=none {PIP} --no-index --no-deps --no-build-isolation --use-pep517 -e . && {CHECK}")
    else:
        lines.append(f"ENV PYTHONPATH={WORKDIR}")
    if with_bug:
        lines.append(f"COPY {BUG}/ {WORKDIR}/")
    # One commit, the bug in it: the agent's `git diff` shows its own work and nothing of how the bug was made.
    lines.append(
        "RUN --network=none git init -q && git add -A && git -c user.name=trajproxy "
        "-c user.email=tasks@trajproxy.invalid commit -qm 'the project'"
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
