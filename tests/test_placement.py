"""tests/placement.py under pytest-xdist: a file's tests run on one worker, the tests that use the session's vLLM all
run on one worker whichever file they are in (one vLLM started, not one per worker), and a marked group stays together.
A run of its own, on a suite written here whose `vllm` fixture only notes the worker it ran on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.tasks import ROOT
from tests.placement import DURATIONS, PER_TEST_S, RECORD, weights

CONFTEST = """
import json, os
import pytest

def pytest_configure(config):
    config.pluginmanager.import_plugin("tests.placement")

@pytest.fixture(scope="session")
def vllm():
    return "served"

@pytest.fixture
def note(request):
    yield
    with open(os.environ["WHERE"], "a") as out:
        out.write(json.dumps([request.node.nodeid, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
"""


def suite(folder: Path) -> None:
    folder.mkdir()
    (folder / "conftest.py").write_text(CONFTEST)
    for name in ("alpha", "beta", "gamma", "delta"):
        tests = "".join(f"def test_{name}_{n}(note): pass\n" for n in range(6))
        (folder / f"test_{name}.py").write_text(tests + f"def test_{name}_served(note, vllm): pass\n")
    (folder / "test_marked.py").write_text(
        "import pytest\n"
        + "".join(f"@pytest.mark.xdist_group('pair')\ndef test_marked_{n}(note): pass\n" for n in range(2))
        + "def test_unmarked(note): pass\n"
    )


@pytest.mark.parametrize("dist", ["loadfile", "loadgroup"])
def test_each_file_on_one_worker_and_every_vllm_test_on_one(tmp_path: Path, dist: str) -> None:
    suite(tmp_path / "suite")
    where = tmp_path / "where.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", dist, "-p", "no:cacheprovider", "-q", "suite"],
        cwd=tmp_path,
        env={**os.environ, "WHERE": str(where), "PYTHONPATH": str(ROOT), RECORD: str(tmp_path / "took.json")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    ran = dict(json.loads(line) for line in where.read_text().splitlines())
    assert len(ran) == 4 * 7 + 3
    assert len(set(ran.values())) == 2  # both workers had work
    served = {worker for nodeid, worker in ran.items() if nodeid.endswith("_served")}
    assert len(served) == 1, ran
    for name in ("alpha", "beta", "gamma", "delta"):
        workers = {worker for nodeid, worker in ran.items() if f"test_{name}_" in nodeid and "served" not in nodeid}
        assert len(workers) == 1, ran
    assert ran["suite/test_marked.py::test_marked_0"] == ran["suite/test_marked.py::test_marked_1"]
    took = json.loads((tmp_path / "took.json").read_text())  # every test's seconds, from both workers
    assert sorted(took) == sorted(ran) and all(seconds >= 0 for seconds in took.values())


def test_a_groups_weight_is_its_tests_recorded_seconds_and_the_mean_for_a_test_not_recorded() -> None:
    groups = {"a.py::one": "a.py", "a.py::two": "a.py", "b.py::one": "b.py", "c.py::x": "pair", "d.py::y": "pair"}
    recorded = {"a.py::one": 0.5, "a.py::two": 0.25, "b.py::one": 40.0, "c.py::x": 3.0, "gone.py::z": 99.0}
    weight = weights(groups, recorded)
    assert weight == {"a.py": 0.75, "b.py": 40.0, "pair": 3.0 + PER_TEST_S}
    assert sorted(weight, key=lambda group: -weight[group]) == ["b.py", "pair", "a.py"]  # the one long test first


def test_the_recorded_durations_name_tests_that_exist() -> None:
    """tests/durations.json is read by test id: ids of tests since renamed would silently weigh nothing."""
    recorded = json.loads(DURATIONS.read_text())
    files = {nodeid.split("::")[0] for nodeid in recorded}
    assert all((ROOT / file).is_file() for file in files), sorted(file for file in files if not (ROOT / file).is_file())
    assert len(recorded) > 1000 and all(seconds >= 0 for seconds in recorded.values())
