"""The project's own test suite in its built image, run twice: the tests that pass both times (flaky ones are left
out and listed), what the suite costs, and which tests run each line of the source (coverage contexts)."""

from __future__ import annotations

import contextlib
import json
import shlex
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.backends.interface import Limits, Sandbox, SandboxSpec
from sandbox.tasks.taskmaker.environment import WORKDIR
from sandbox.tasks.taskmaker.project import SourceError

PROBE = Path(__file__).with_name("probe.py")
PROBE_IN_BOX = "/opt/trajproxy/trajproxy_probe.py"  # a name no project's own module has
BASELINE_TIMEOUT_S = 1800.0


@dataclass(frozen=True, slots=True)
class Baseline:
    passing: tuple[str, ...]  # pass both times, in the suite's order
    flaky: tuple[str, ...]  # passed once, failed or skipped the other time
    failing: int  # fail both times (left out too)
    seconds: float  # one run of the whole suite, without coverage
    peak_mb: float
    covering: dict[str, dict[int, frozenset[str]]] = field(default_factory=dict)  # file -> line -> passing tests

    def tests_of(self, file: str, first: int, last: int) -> frozenset[str]:
        lines = self.covering.get(file, {})
        return frozenset().union(*(lines.get(line, frozenset()) for line in range(first, last + 1)))


@contextlib.asynccontextmanager
async def probe_box(sandboxes: DockerSandboxes, image: str, limits: Limits) -> AsyncIterator[Sandbox]:
    """A container of `image` with no network, the probe in it; removed whatever happens."""
    box = await sandboxes.start(SandboxSpec(image, workdir=WORKDIR, limits=limits, proxy=False))
    try:
        await box.upload(PROBE_IN_BOX, PROBE.read_bytes())
        yield box
    finally:
        await box.stop()


async def run_baseline(box: Sandbox, sources: tuple[str, ...]) -> Baseline:
    """The suite run twice in `box`; coverage measured on `sources` (the source files' top folders or modules)."""
    measured = " ".join(shlex.quote(source) for source in sources)
    command = f"python {PROBE_IN_BOX} baseline /tmp/baseline.json {measured}"
    ran = await box.exec(command, timeout_s=BASELINE_TIMEOUT_S)
    if not ran.ok:
        raise SourceError(f"the test suite could not be run in the built image: {_last_line(ran.output)}")
    found = json.loads(await box.download("/tmp/baseline.json"))
    first, second = (run["tests"] for run in found["runs"])
    passing = tuple(test for test, seen in first.items() if seen["outcome"] == "passed" and _passed(second, test))
    flaky = tuple(sorted(test for test in set(first) | set(second) if _passed(first, test) != _passed(second, test)))
    failing = sum(1 for test, seen in first.items() if seen["outcome"] == "failed" and not _passed(second, test))
    if not passing:
        raise SourceError(_why_none_pass(found["runs"][1]))
    kept = set(passing)
    # A line that also ran while the tests were collected (the empty context) runs on import: a bug there would
    # fail every test, not some, so it gets no tests and no bug.
    covering = {
        file: {
            int(line): frozenset(_node(context) for context in contexts) & kept
            for line, contexts in lines.items()
            if "" not in contexts
        }
        for file, lines in found["contexts"].items()
    }
    last = found["runs"][1]
    return Baseline(passing, flaky, failing, last["seconds"], max(r["peak_mb"] for r in found["runs"]), covering)


def _passed(tests: dict[str, Any], test: str) -> bool:
    return bool(tests.get(test, {}).get("outcome") == "passed")


def _node(context: str) -> str:
    """pytest-cov's context for a test phase ("tests/test_x.py::test_y|run") as the test's node id."""
    return context.rpartition("|")[0] or context


def _why_none_pass(run: dict[str, Any]) -> str:
    tests, errors = run["tests"], run.get("collection_errors", [])
    if errors and not tests:
        return f"no test runs: collecting them failed ({errors[0]})"
    if not tests:
        return f"no test runs: pytest collected none ({_last_line(run.get('output', ''))})"
    failed = sum(1 for seen in tests.values() if seen["outcome"] == "failed")
    return f"no passing tests: of {len(tests)} tests none passes twice ({failed} fail, the rest skip)"


def _last_line(output: str) -> str:
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"
