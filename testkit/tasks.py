"""The repository's example task (examples/tasks/calc) and the minimal agent as the task's image runs it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tasks" / "calc"
# The minimal agent as its image installs it (agents/minimal/Dockerfile; the example task's image builds on it), run
# as a command already in the image (--agent-cmd): no bundle to build or mount.
BAKED_MINIMAL = "minimal-agent @{task_file} --workdir {workdir}"
