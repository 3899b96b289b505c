"""The skips a CI run may have: under CI (`CI` set, as `.ci/run` sets it) any other skip fails the run (a plugin)."""

from __future__ import annotations

import os
from collections.abc import Collection

import pytest

# Each skip CI may have, by its exact reason, with why it hides nothing CI could test. A skip of anything .ci/run
# installs (Docker, Postgres, Chromium, the agent CLIs, Ray) or a CI machine must allow (unshare) does not belong here.
EXPECTED = frozenset(
    {
        # tests/test_security.py: a machine with IPv6 switched off (a container, often) cannot bind "::"; the same
        # refusal of a non-loopback bind without a token still runs on 0.0.0.0 and on the machine's own address.
        "no IPv6 on this machine",
        # tests/test_security.py: a machine with no route out has only loopback; the 0.0.0.0 bind's tests still run.
        "this machine has no non-loopback address",
    }
)


class SkipAudit:
    """Collects every skip whose reason is not expected; the session then fails, naming each."""

    def __init__(self, expected: Collection[str]) -> None:
        self._expected = expected
        self.unexpected: list[tuple[str, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._check(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._check(report)

    def _check(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        reason = reason_of(report)
        if reason not in self._expected:
            self.unexpected.append((report.nodeid, reason))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.unexpected and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.unexpected:
            return
        terminalreporter.section("skips CI did not expect (each hides a feature from CI)", red=True)
        for nodeid, reason in self.unexpected:
            terminalreporter.line(f"SKIPPED {nodeid}: {reason}")
        terminalreporter.line("install what they need in .ci/run, or list the reason in tests/skips.py with why")


def reason_of(report: pytest.TestReport | pytest.CollectReport) -> str:
    """A skip's reason as it was given (a report carries it as (path, line, "Skipped: reason"); through
    pytest-xdist, as a list)."""
    longrepr = report.longrepr
    said = str(longrepr[2]) if isinstance(longrepr, tuple | list) and len(longrepr) == 3 else str(longrepr)
    return said.removeprefix("Skipped: ")


def pytest_configure(config: pytest.Config) -> None:
    """Under CI, on the process that reports (pytest-xdist's controller, which hears its workers' reports)."""
    if os.environ.get("CI") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(SkipAudit(EXPECTED), "trajproxy-skip-audit")
