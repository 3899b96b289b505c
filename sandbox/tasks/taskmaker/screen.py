"""Candidate bugs tried in batches in one container of the base image: each written in place, the tests that run
its lines run with a time limit, the file restored. A candidate is kept when some of those tests now fail."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

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


def batches(candidates: list[Candidate]) -> Iterator[list[Candidate]]:
    for start in range(0, len(candidates), BATCH):
        yield candidates[start : start + BATCH]


async def screen(box: Sandbox, batch: list[Candidate], baseline: Baseline) -> list[Screened]:
    per_test_s = baseline.seconds / max(1, len(baseline.passing))
    spec = [
        {
            "id": str(index),
            "file": candidate.mutation.file,
            "source": candidate.source.decode("utf-8"),
            "tests": sorted(candidate.tests),
            "timeout_s": STARTUP_S + 10 * per_test_s * len(candidate.tests),
        }
        for index, candidate in enumerate(batch)
    ]
    await box.upload("/tmp/batch.json", json.dumps(spec).encode())
    budget_s = sum(item["timeout_s"] for item in spec) + 60  # type: ignore[misc]
    ran = await box.exec(f"python {PROBE_IN_BOX} mutants /tmp/batch.json /tmp/screened.json", timeout_s=budget_s)
    if not ran.ok:
        return [Screened(candidate, {}, True, 0.0) for candidate in batch]
    found = json.loads(await box.download("/tmp/screened.json"))
    screened = []
    for index, candidate in enumerate(batch):
        result = found[str(index)]
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
