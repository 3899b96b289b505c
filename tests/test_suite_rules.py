"""Rules the test suite keeps about itself: under CI a skip nobody expected fails the run, and no test asserts on
how long something took (these machines are shared and noisy: tests wait for events, bounded, instead)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
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
