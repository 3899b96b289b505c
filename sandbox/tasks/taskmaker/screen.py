"""Candidate bugs tried in batches in one container of the base image: each written in place, the tests that run
its lines run with a time limit, the file restored. A candidate is kept when some of those tests now fail, and then
confirmed on the whole suite: which tests it fails and which still pass is what the suite does, never inferred."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sandbox.backends.interface import Sandbox
from sandbox.tasks.taskmaker.baseline import PROBE_IN_BOX, Baseline
from sandbox.tasks.taskmaker.mutate import Mutation

BATCH = 16
STARTUP_S = 8.0  # pytest's own start, on top of the tests' time


@dataclass(frozen=True, slots=True)
class Candidate:
    mutation: Mutation
    source: bytes  # the file with the bug in it
    tests: frozenset[str]  # the passing tests that run its lines


@dataclass(frozen=True, slots=True)
class Screened:
    candidate: Candidate
    failing: dict[str, str]  # test -> what it observed (the failure's message); empty: the bug is not seen
    timed_out: bool
    seconds: float
    passing: tuple[str, ...] | None = None  # once confirmed: the tests that passed before and pass with the bug too


def batches(candidates: list[Candidate]) -> Iterator[list[Candidate]]:
    for start in range(0, len(candidates), BATCH):
        yield candidates[start : start + BATCH]


async def screen(box: Sandbox, batch: list[Candidate], baseline: Baseline) -> list[Screened]:
    per_test_s = baseline.seconds / max(1, len(baseline.passing))
    timeouts = [STARTUP_S + 10 * per_test_s * len(candidate.tests) for candidate in batch]
    found = await _run(
        box,
        [(candidate, sorted(candidate.tests), timeout_s) for candidate, timeout_s in zip(batch, timeouts, strict=True)],
    )
    screened = []
    for candidate, result in zip(batch, found, strict=True):
        outcomes = result.get("tests", {})
        failing = {
            test: outcomes[test]["message"]
            for test in sorted(candidate.tests)
            if outcomes.get(test, {}).get("outcome") == "failed"
        }
        if result.get("collection_errors") or not candidate.tests <= outcomes.keys():
            failing = {}  # it breaks more than its tests: an import, a module the suite collects
        screened.append(Screened(candidate, failing, result["timed_out"], result["seconds"]))
    return screened


async def confirm(box: Sandbox, kept: list[Screened], baseline: Baseline) -> list[Screened]:
    """The whole suite run on each bug's tree, not only the tests coverage saw run its lines (a test that runs the
    project in a process of its own is invisible to coverage): a test that passed before is to be fixed when it
    does not pass now, to keep passing when it does. A bug that stops the suite from running gets no failing test."""
    timeout_s = STARTUP_S + 10 * baseline.seconds
    found = await _run(box, [(screened.candidate, [], timeout_s) for screened in kept])
    confirmed = []
    for screened, result in zip(kept, found, strict=True):
        outcomes = result.get("tests", {})
        seen = {test: _observed(outcomes[test]) for test in baseline.passing if test in outcomes}
        failing = {test: said for test, said in seen.items() if said is not None}
        passing = tuple(test for test, said in seen.items() if said is None)
        if result.get("collection_errors") or not set(baseline.passing) <= outcomes.keys():
            failing = {}
        confirmed.append(Screened(screened.candidate, failing, result["timed_out"], result["seconds"], passing))
    return confirmed


def _observed(outcome: dict[str, str]) -> str | None:
    """What a test that passed before shows now: None when it still passes."""
    if outcome["outcome"] == "passed":
        return None
    return outcome["message"] if outcome["outcome"] == "failed" else "it is skipped now"


async def _run(box: Sandbox, items: list[tuple[Candidate, list[str], float]]) -> list[dict[str, Any]]:
    """Each candidate's file written in turn, its tests run (none named: the whole suite), the file restored."""
    spec = [
        {"id": str(index), "file": candidate.mutation.file, "source": candidate.source.decode("utf-8"),
         "tests": tests, "timeout_s": timeout_s}
        for index, (candidate, tests, timeout_s) in enumerate(items)
    ]  # fmt: skip
    await box.upload("/tmp/batch.json", json.dumps(spec).encode())
    budget_s = sum(timeout_s for _, _, timeout_s in items) + 60
    ran = await box.exec(f"python {PROBE_IN_BOX} mutants /tmp/batch.json /tmp/screened.json", timeout_s=budget_s)
    if not ran.ok:
        return [{"timed_out": True, "seconds": 0.0, "tests": {}} for _ in items]
    found = json.loads(await box.download("/tmp/screened.json"))
    return [found[str(index)] for index in range(len(items))]
