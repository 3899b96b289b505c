"""Where each test runs under pytest-xdist (`-n N --dist loadfile` or `loadgroup`, as .ci/run runs them): a file's
tests on one worker, so that its fixtures are made once; a test marked `xdist_group(name)` with that group's; and every
test that uses the session's vLLM (the `vllm` fixture, directly or through another) on one worker, whichever file it
is in, so that one vLLM starts, not one per worker (each worker is a session of its own). Nothing to mark: a new test
that asks for `vllm` joins them.

Each worker writes the groups it found before it reports its collection; the controller's scheduler (pytest-xdist's
own, by scope) reads them when it splits the collection, once every worker has reported. pytest-xdist's loadgroup
cannot be used for this: it renames the items (`_nodeid`), which pytest 9 no longer reads."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

VLLM = "vllm"
KEY = "trajproxy_groups"
LISTING = pytest.StashKey[Path]()
# Each test's seconds (setup, call and teardown) in a quiet run of .ci/run's stages, so that the groups go out longest
# first and no worker is left with a long one at the end while the other waits: remade by running the stages with
# TRAJPROXY_TEST_DURATIONS=tests/durations.json (each run's tests merged into what the file holds).
DURATIONS = Path(__file__).with_name("durations.json")
RECORD = "TRAJPROXY_TEST_DURATIONS"
PER_TEST_S = 1.9  # a test the file does not hold: about the suite's mean


def group_of(item: pytest.Item) -> str:
    marked = item.get_closest_marker("xdist_group")
    if marked is not None:
        return str(marked.args[0] if marked.args else marked.kwargs.get("name", "default"))
    if VLLM in getattr(item, "fixturenames", ()):
        return VLLM
    return item.nodeid.split("::")[0]


# The controller


class ByGroup(LoadScopeScheduling):  # type: ignore[misc]  # pytest-xdist is untyped
    """pytest-xdist's scheduling by scope, a scope being a test's group; the longest first (the workers ordered the
    collection: vLLM's group, then the others by their expected seconds, `weights`)."""

    def __init__(self, config: pytest.Config, log: Any, listing: Path) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False
        self.listing = listing
        self.groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self.groups is None:
            self.groups = {}
            for each in sorted(self.listing.glob("*.json")):
                self.groups.update(json.loads(each.read_text()))
        return self.groups.get(nodeid) or nodeid.split("::")[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadScopeScheduling | None:
    if config.getvalue("dist") not in ("loadfile", "loadgroup"):
        return None
    return ByGroup(config, log, _listing(config))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    node.workerinput[KEY] = str(_listing(node.config))


def pytest_unconfigure(config: pytest.Config) -> None:
    if LISTING in config.stash:
        shutil.rmtree(config.stash[LISTING], ignore_errors=True)


def _listing(config: pytest.Config) -> Path:
    if LISTING not in config.stash:
        config.stash[LISTING] = Path(tempfile.mkdtemp(prefix="tp-groups"))
    return config.stash[LISTING]


# Each worker


@pytest.hookimpl(trylast=True)  # after the deselections: the collection as it will run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    given: dict[str, Any] = getattr(config, "workerinput", {})  # what the controller gave this worker
    listing = given.get(KEY)
    if listing is None:
        return
    groups = {item.nodeid: group_of(item) for item in items}
    weight = weights(groups, json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {})
    items.sort(key=lambda item: (groups[item.nodeid] != VLLM, -weight[groups[item.nodeid]]))  # stable
    mine = Path(listing) / f"{given['workerid']}.json"
    mine.write_text(json.dumps({nodeid: group for nodeid, group in groups.items() if group != nodeid.split("::")[0]}))


def weights(groups: dict[str, str], durations: dict[str, float]) -> dict[str, float]:
    """Each group's expected seconds: its tests' recorded durations, a test with none counted at PER_TEST_S."""
    weight: dict[str, float] = {}
    for nodeid, group in groups.items():
        weight[group] = weight.get(group, 0.0) + durations.get(nodeid, PER_TEST_S)
    return weight


# The durations, recorded where TRAJPROXY_TEST_DURATIONS names a file (by the controller, which hears every worker)

_took: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get(RECORD):
        _took[report.nodeid] = _took.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(RECORD)
    if not path or hasattr(session.config, "workerinput") or not _took:
        return
    with open(f"{path}.lock", "w") as lock:  # .ci/run's last stages run side by side, each merging its own
        fcntl.flock(lock, fcntl.LOCK_EX)
        held = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
        held.update({nodeid: round(seconds, 1) for nodeid, seconds in _took.items()})
        Path(path).write_text(json.dumps(dict(sorted(held.items())), indent=0) + "\n")
