"""Runs inside a task's container, where only Python and pytest are: each test's outcome as JSON, for the baseline,
the screening of candidate bugs, and a made task's verifier. Nothing of trajproxy's is imported here.

    python probe.py baseline OUT.json [SOURCE…]  the whole suite, twice; the first run records which tests ran each
                                                line of the SOURCE folders or modules (default: every file)
    python probe.py mutants BATCH.json OUT.json each candidate bug in turn: write its file, run its tests, restore it
    python probe.py verify SPEC.json            the verifier: named rewards to /logs/verifier/reward.json

As a pytest plugin (`-p` with this file's name) it writes each test's outcome, and the message of its failure, to
$PROBE_OUTCOMES.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_outcomes: dict[str, dict[str, str]] = {}
_collection_errors: list[str] = []
PYTEST = [
    sys.executable,
    "-m",
    "pytest",
    "-p",
    Path(__file__).stem,
    "-p",
    "no:cacheprovider",
    "-q",
    "--no-header",
    "-rN",
]
REWARDS = Path("/logs/verifier/reward.json")


def pytest_runtest_logreport(report: Any) -> None:
    seen = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if report.failed and seen["outcome"] != "failed":
        crash = getattr(report.longrepr, "reprcrash", None)
        seen.update(outcome="failed", message=str(getattr(crash, "message", report.longrepr))[:600])
    elif report.skipped and seen["outcome"] == "passed":
        seen["outcome"] = "skipped"


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _collection_errors.append(f"{report.nodeid}: {str(report.longrepr).strip().splitlines()[-1][:300]}")


def pytest_sessionfinish(session: Any) -> None:
    path = os.environ.get("PROBE_OUTCOMES")
    if path:
        Path(path).write_text(json.dumps({"tests": _outcomes, "collection_errors": _collection_errors}))


def run_tests(args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """pytest on `args` (node ids, or nothing for the whole suite): each test's outcome, seconds, peak memory."""
    out = Path("/tmp/probe-outcomes.json")
    out.unlink(missing_ok=True)
    here = str(Path(__file__).parent)
    full_env = {**os.environ, **(env or {}), "PROBE_OUTCOMES": str(out)}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, full_env.get("PYTHONPATH", "")]))
    started = time.monotonic()
    try:
        ran = subprocess.run([*PYTEST, *args], env=full_env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"timed_out": True, "tests": {}, "seconds": timeout_s, "output": ""}
    found = json.loads(out.read_text()) if out.is_file() else {"tests": {}, "collection_errors": []}
    return {
        **found,
        "timed_out": False,
        "exit_code": ran.returncode,
        "seconds": round(time.monotonic() - started, 3),
        "peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "output": (ran.stdout + ran.stderr)[-3000:],
    }


def baseline(out: str, *sources: str) -> None:
    data = "/tmp/probe.coverage"
    measured = [f"--cov={source}" for source in sources or ["."]]  # the tests themselves cost time and tell nothing
    covered = run_tests([*measured, "--cov-context=test", "--cov-report="], 3600, {"COVERAGE_FILE": data})
    again = run_tests([], 3600)
    contexts: dict[str, dict[str, list[str]]] = {}
    if Path(data).is_file():
        report = "/tmp/probe-coverage.json"
        command = [sys.executable, "-m", "coverage", "json", "-q", "--show-contexts", "--data-file", data, "-o", report]
        subprocess.run(command, check=False, capture_output=True)
        if Path(report).is_file():
            files = json.loads(Path(report).read_text())["files"]
            contexts = {os.path.relpath(name): found.get("contexts", {}) for name, found in files.items()}
    Path(out).write_text(json.dumps({"runs": [covered, again], "contexts": contexts}))


def mutants(batch: str, out: str) -> None:
    results = {}
    env = {"PYTHONDONTWRITEBYTECODE": "1"}  # a restored file must never meet a mutant's cached bytecode
    for mutant in json.loads(Path(batch).read_text()):
        path = Path(mutant["file"])
        original, stat = path.read_bytes(), path.stat()
        try:
            path.write_text(mutant["source"], encoding="utf-8")
            results[mutant["id"]] = run_tests(mutant["tests"], mutant["timeout_s"], env)
        finally:
            path.write_bytes(original)
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    Path(out).write_text(json.dumps(results))


def changed_lines() -> dict[str, set[int]]:
    """The lines each Python file has now that it did not have in the task's commit."""
    diff = subprocess.run(["git", "diff", "-U0", "HEAD", "--", "*.py"], capture_output=True, text=True).stdout
    lines: dict[str, set[int]] = {}
    current = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            current = line[6:] if line.startswith("+++ b/") else None
        elif (hunk := re.match(r"@@ -\S+ \+(\d+)(?:,(\d+))? @@", line)) and current is not None:
            start, count = int(hunk.group(1)), int(hunk.group(2) or 1)
            lines.setdefault(current, set()).update(range(start, start + count))
    return lines


def style(changed: dict[str, set[int]]) -> float:
    """1 less the share of changed lines that ruff (its default rules, not the project's) finds fault with."""
    total = sum(len(lines) for lines in changed.values())
    if not total:
        return 1.0
    command = ["ruff", "check", "--isolated", "--output-format", "json", "--exit-zero", *changed]
    ran = subprocess.run(command, capture_output=True, text=True)
    found = json.loads(ran.stdout or "[]")
    faults = {(os.path.relpath(f["filename"]), f["location"]["row"]) for f in found}
    bad = sum(1 for name, row in faults if row in changed.get(name, set()))
    return max(0.0, 1.0 - bad / total)


def verify(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    fail_to_pass, pass_to_pass = spec["fail_to_pass"], spec["pass_to_pass"]
    ran = run_tests([*fail_to_pass, *pass_to_pass], spec["timeout_s"])
    passed = {test for test, seen in ran["tests"].items() if seen["outcome"] == "passed"}
    tests = sum(test in passed for test in fail_to_pass) / len(fail_to_pass)
    regressions = sum(test not in passed for test in pass_to_pass) / max(1, len(pass_to_pass))
    kept_style = style(changed_lines()) if tests > 0 else 0.0  # a change that fixes nothing earns no style
    weight = {
        name: float(os.environ.get(f"WEIGHT_{name.upper()}", default)) for name, default in spec["weights"].items()
    }
    reward = max(0.0, weight["tests"] * tests + weight["style"] * kept_style - weight["regressions"] * regressions)
    named = {"reward": reward, "tests": tests, "regressions": regressions, "style": kept_style}
    REWARDS.parent.mkdir(parents=True, exist_ok=True)
    REWARDS.write_text(json.dumps({name: round(value, 6) for name, value in named.items()}))
    print(json.dumps({**named, "failing": sorted(set(fail_to_pass + pass_to_pass) - passed)[:20]}))


if __name__ == "__main__":
    commands: dict[str, Any] = {"baseline": baseline, "mutants": mutants, "verify": verify}
    commands[sys.argv[1]](*sys.argv[2:])
