"""Rules the test suite keeps about itself: under CI a skip nobody expected fails the run, and no test asserts on
how long something took (these machines are shared and noisy: tests wait for events, bounded, instead)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.tasks import ROOT
from tests.skips import EXPECTED

SKIPPING = """
import pytest

def test_that_runs():
    pass

def test_of_a_feature_this_machine_lacks():
    pytest.skip("no frobnicator here")

@pytest.mark.skipif(True, reason="a marked skip")
def test_marked():
    pass

def test_of_what_no_machine_can_help():
    pytest.skip({expected!r})
"""


def pytest_run(folder: Path, *args: str, ci: bool) -> subprocess.CompletedProcess[str]:
    """pytest on the tests in `folder` with the suite's skip audit (tests/skips.py, as conftest loads it), CI set or
    not."""
    env = {key: value for key, value in os.environ.items() if key != "CI"} | ({"CI": "true"} if ci else {})
    env |= {"PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the installed plugins take seconds
    plugins = ["-p", "xdist.plugin", "-p", "tests.skips", "-p", "no:cacheprovider"]
    command = [sys.executable, "-m", "pytest", *plugins, str(folder), *args]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def skipping(tmp_path: Path) -> Path:
    (tmp_path / "test_skipping.py").write_text(SKIPPING.format(expected=sorted(EXPECTED)[0]))
    return tmp_path


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["alone", "xdist"])
def test_under_ci_a_skip_nobody_expected_fails_the_run(skipping: Path, workers: list[str]) -> None:
    done = pytest_run(skipping, *workers, ci=True)
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    said = done.stdout[done.stdout.index("skips CI did not expect") :]
    assert "test_of_a_feature_this_machine_lacks: no frobnicator here" in said, said
    assert "test_marked: a marked skip" in said, said
    assert "test_of_what_no_machine_can_help" not in said and "test_that_runs" not in said, said
    assert "1 passed, 3 skipped" in done.stdout


def test_under_ci_the_expected_skips_pass_and_outside_ci_every_skip_does(skipping: Path) -> None:
    expected = pytest_run(skipping, "-k", "no_machine or runs", ci=True)
    assert expected.returncode == pytest.ExitCode.OK, expected.stdout + expected.stderr
    assert "skips CI did not expect" not in expected.stdout
    outside = pytest_run(skipping, ci=False)
    assert outside.returncode == pytest.ExitCode.OK, outside.stdout + outside.stderr
    assert "1 passed, 3 skipped" in outside.stdout and "skips CI did not expect" not in outside.stdout


def test_the_suite_loads_the_audit(request: pytest.FixtureRequest) -> None:
    assert request.config.pluginmanager.has_plugin("tests.skips")


def test_ci_run_runs_every_test_under_ci() -> None:
    """`.ci/run` sets CI itself, before its first test, so every skip guard and the audit above apply there."""
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    exported = next(i for i, line in enumerate(script) if line.strip() == "export CI=true")
    first_test = next(i for i, line in enumerate(script) if "-m pytest" in line)
    assert exported < first_test


CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}


def upper_bounds_on_elapsed_time(source: str) -> list[int]:
    """The lines of asserts that bound a measured duration from above (`time.monotonic() - started < 5`, or a name
    holding such a difference): what a slow moment of a shared machine fails. A lower bound (`took_s >= sleep_s`),
    measured from before its cause, cannot fail by slowness, and a deadline (`time.monotonic() < deadline`) bounds a
    wait for an event: both pass."""
    found = set()
    for function in ast.walk(ast.parse(source)):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            found |= set(Durations(function).upper_bounds())
    return sorted(found)


class Durations:
    """One function's clock readings (`started = time.monotonic()`), the durations it measures from them
    (`took_s = time.monotonic() - started`), and its asserts that bound one from above."""

    def __init__(self, function: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._nodes = list(ast.walk(function))
        self._clocks = {name for node in self._nodes for name, value in assigned(node) if reads_clock(value)}
        self._durations = {name for node in self._nodes for name, value in assigned(node) if self._elapsed(value)}

    def upper_bounds(self) -> Iterator[int]:
        for node in self._nodes:
            if not isinstance(node, ast.Assert):
                continue
            for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                sides = [compare.left, *compare.comparators]
                for left, op, right in zip(sides, compare.ops, sides[1:], strict=False):
                    below = isinstance(op, ast.Lt | ast.LtE) and self._measured(left)
                    if below or (isinstance(op, ast.Gt | ast.GtE) and self._measured(right)):
                        yield node.lineno

    def _elapsed(self, expr: ast.AST) -> bool:
        return any(
            isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and self._read(node.left, node.right)
            for node in ast.walk(expr)
        )

    def _read(self, *sides: ast.expr) -> bool:
        return any(reads_clock(side) or (isinstance(side, ast.Name) and side.id in self._clocks) for side in sides)

    def _measured(self, expr: ast.expr) -> bool:
        names = (node.id for node in ast.walk(expr) if isinstance(node, ast.Name))
        return self._elapsed(expr) or any(name in self._durations for name in names)


def assigned(node: ast.AST) -> list[tuple[str, ast.expr]]:
    """The plain names an assignment binds, each with the value bound (none for anything else)."""
    if isinstance(node, ast.Assign):
        return [(target.id, node.value) for target in node.targets if isinstance(target, ast.Name)]
    if isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name) and node.value:
        return [(node.target.id, node.value)]
    return []


def reads_clock(expr: ast.AST) -> bool:
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in CLOCKS
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "time"
        for node in ast.walk(expr)
    )


def test_the_lint_finds_an_upper_bound_on_elapsed_time() -> None:
    source = """
def test_quick():
    started = time.monotonic()
    act()
    took_s = time.monotonic() - started
    assert took_s < 5
    assert 5 > time.monotonic() - started
    assert took_s >= 1  # a lower bound: slowness cannot fail it
    deadline = time.monotonic() + 5
    assert time.monotonic() < deadline  # a bounded wait
"""
    assert upper_bounds_on_elapsed_time(source) == [6, 7]


def test_no_test_bounds_how_long_something_took() -> None:
    """Tests wait for events (a status, a log line, a reply), bounded; a time limit is no assertion of theirs."""
    found = {
        f"{path.name}:{line}": path.read_text().splitlines()[line - 1].strip()
        for path in sorted((ROOT / "tests").glob("*.py"))
        for line in upper_bounds_on_elapsed_time(path.read_text())
    }
    assert not found, found
