"""A kept bug written as a Harbor task directory: an issue-like instruction from what the failing tests observed,
the image's build context, a verifier that writes named rewards, the reverse change as the solution, and task.toml
with limits from the baseline's cost. No difficulty label: nothing measured here predicts how hard a bug is to fix
(an estimate from the kind of change and the tests' distance to it called a NameError hard)."""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.tasks.taskmaker.baseline import PROBE, Baseline
from sandbox.tasks.taskmaker.environment import WORKDIR, write_context
from sandbox.tasks.taskmaker.project import Project
from sandbox.tasks.taskmaker.screen import Screened

# reward = max(0, tests * WEIGHT_TESTS + style * WEIGHT_STYLE - regressions * WEIGHT_REGRESSIONS)
WEIGHTS = {"tests": 0.9, "style": 0.1, "regressions": 1.0}
AGENT_TIMEOUT_S = 900
BUILD_TIMEOUT_S = 900
SHOWN_TESTS = 8
HINTS = re.compile(r"^(Use -v to get|Full diff:|Omitting \d+ identical items)")
TEST_SH = f"""#!/bin/bash
# The verifier: the project's tests restored as they were (the agent may have changed them), then the tests the bug
# fails and the tests that must keep passing; named rewards go to /logs/verifier/reward.json.
set -u
cd {WORKDIR}
cp -a /tests/project/. {WORKDIR}/
python /tests/trajproxy_probe.py verify /tests/spec.json
"""


@dataclass(frozen=True, slots=True)
class Made:
    id: str
    folder: Path
    row: dict[str, Any]  # the task's line in the index


def task_id(project: Project, screened: Screened) -> str:
    mutation = screened.candidate.mutation
    digest = hashlib.sha256(f"{mutation.file}\0{mutation.edits}".encode()).hexdigest()[:8]
    return f"{project.name}-{mutation.kind}-{digest}"


def write_task(out: Path, project: Project, baseline: Baseline, screened: Screened, source_name: str) -> Made:
    candidate, mutation = screened.candidate, screened.candidate.mutation
    ident = task_id(project, screened)
    folder = out / ident
    if screened.passing is None:
        raise ValueError("a bug is written as a task only once the whole suite has run on it (screen.confirm)")
    original = (project.root / mutation.file).read_bytes()
    write_context(project, folder / "environment", {mutation.file: candidate.source})
    fail_to_pass, pass_to_pass = sorted(screened.failing), list(screened.passing)
    fix = _diff(mutation.file, candidate.source, original)
    verifier_s = math.ceil(max(60.0, 4 * baseline.seconds + 30))
    (folder / "instruction.md").write_text(
        instruction(project.name, screened.failing, len(pass_to_pass)), encoding="utf-8"
    )
    tests = folder / "tests"
    for path in project.test_files:
        (tests / "project" / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(project.root / path, tests / "project" / path)
    shutil.copy2(PROBE, tests / "trajproxy_probe.py")
    spec = {
        "fail_to_pass": fail_to_pass,
        "pass_to_pass": pass_to_pass,
        "timeout_s": verifier_s - 10,
        "weights": WEIGHTS,
    }
    (tests / "spec.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
    (tests / "test.sh").write_text(TEST_SH, encoding="utf-8")
    (folder / "solution").mkdir()
    solve = f"#!/bin/bash\n# The reference fix: the bug's change, reversed.\nset -euo pipefail\ncd {WORKDIR}\n"
    (folder / "solution" / "solve.sh").write_text(
        f"{solve}git apply --whitespace=nowarn <<'TRAJPROXY_FIX'\n{fix}TRAJPROXY_FIX\n"
    )
    memory_mb = max(1024, math.ceil(baseline.peak_mb * 2 / 256) * 256)
    (folder / "task.toml").write_text(_toml(source_name, mutation.kind, verifier_s, memory_mb), encoding="utf-8")
    row = {
        "id": ident,
        "kind": mutation.kind,
        "files": [mutation.file],
        "line": mutation.line,
        "change": mutation.description,
        "function": mutation.function,
        "fail_to_pass": fail_to_pass,
        "pass_to_pass": len(pass_to_pass),
    }
    return Made(ident, folder, row)


def solution_script(folder: Path) -> str:
    """A scripted policy's replies (JSONL) that make an injected agent (`minimal`) run the task's solution and stop:
    to check a made task end to end with an agent, as `--policy scripted:FILE` does."""
    solve = (folder / "solution" / "solve.sh").read_text(encoding="utf-8")
    replies = [
        {"content": f"I will apply the fix.\n```bash\n{solve}```"},
        {"content": "Done.\n```bash\necho TASK_COMPLETE\n```"},
    ]
    return "".join(json.dumps(reply) + "\n" for reply in replies)


def instruction(name: str, failing: dict[str, str], passing: int) -> str:
    """The bug as a user reports it: which tests no longer pass and what they observed, and how many still pass, as
    the suite ran on the buggy tree; never where the bug is or how to fix it."""
    shown = sorted(failing)[:SHOWN_TESTS]
    lines = [f"# {len(failing)} test(s) of {name} no longer pass", "", f"After a recent change to {name}, these "
             "tests no longer pass where they passed before:", ""]  # fmt: skip
    for test in shown:
        lines += [
            f"- `{test}`, which reports:",
            "",
            "  ```",
            *(f"  {line}" for line in _observed(failing[test])),
            "  ```",
        ]
    if len(failing) > len(shown):
        lines.append(f"- and {len(failing) - len(shown)} more")
    still = "the 1 other test that passed before still passes" if passing == 1 else (
        f"the {passing} other tests that passed before still pass")  # fmt: skip
    lines += [
        "",
        f"Of the rest of the suite, {still}; tests that failed, were skipped or were flaky before the change are not "
        "part of this issue. Find the cause in the project's source and fix it, so that these tests pass again and "
        "the others keep passing. Do not change the tests.",
        "",
        f"The project is in {WORKDIR}, a git repository; `python -m pytest` runs its tests.",
    ]
    return "\n".join(lines) + "\n"


def _observed(message: str) -> list[str]:
    """A failure's message without pytest's hints to itself, at most a dozen lines."""
    kept = [line.rstrip() for line in message.splitlines() if line.strip() and not HINTS.match(line.strip())]
    return kept[:12] or ["it fails"]


def _diff(file: str, before: bytes, after: bytes) -> str:
    lines = difflib.unified_diff(
        before.decode("utf-8").splitlines(keepends=True),
        after.decode("utf-8").splitlines(keepends=True),
        f"a/{file}",
        f"b/{file}",
    )
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def _toml(source: str, kind: str, verifier_s: int, memory_mb: int) -> str:
    weights = "\n".join(f'WEIGHT_{name.upper()} = "{value:g}"' for name, value in WEIGHTS.items())
    return f"""version = "1.0"

[metadata]
made_by = "trajproxy tasks make"
source = {json.dumps(source)}
kind = {json.dumps(kind)}
category = "debugging"
# reward = max(0, tests * WEIGHT_TESTS + style * WEIGHT_STYLE - regressions * WEIGHT_REGRESSIONS), weights below in
# [verifier.env]; tests: the share of the failing tests fixed; regressions: the share of the passing ones broken;
# style: 1 less the share of changed lines ruff finds fault with (0 when no failing test is fixed).
rewards = ["reward", "tests", "regressions", "style"]

[agent]
timeout_sec = {AGENT_TIMEOUT_S}

[verifier]
timeout_sec = {verifier_s}

[verifier.env]
{weights}

[environment]
build_timeout_sec = {BUILD_TIMEOUT_S}
cpus = 1
memory_mb = {memory_mb}
"""
