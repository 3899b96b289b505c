"""`trajproxy run --ray` on a real Ray cluster of two nodes (two raylets on this machine, each declaring two sandbox
slots) and a real Postgres: a task file with more tasks than one node's slots runs across both, each node's
sandboxes reaching trajproxy through that node's own replica; one node's worker killed mid-run costs its running
tasks (recorded failed, with no reward) and they run again on the other; every task ends recorded once, with its
reward. The two nodes share this machine's Docker engine: `trajproxy.node` on each container says which ran it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy

from proxy.storage.engines import engine_url
from testkit.databases import fresh_schema
from testkit.ray_cluster import SLOTS, two_nodes
from testkit.tasks import EXAMPLE
from tests.conftest import POSTGRES_URL
from tests.test_launch import RUN, ended, started, wait_for

pytestmark = pytest.mark.serial  # a node killed mid-run, on health checks every half second: alone on the cores

needs_postgres = pytest.mark.skipif(
    not POSTGRES_URL and not os.environ.get("CI"),
    reason="no Postgres server: set TRAJPROXY_TEST_POSTGRES_URL (bash .ci/run starts one and sets it)",
)

NODE = "trajproxy.node"
TASKS = 6  # more than one node's slots
SLOW_AGENT = "sleep 4; minimal-agent @{task_file} --workdir {workdir}"  # long enough to be caught running


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    pytest.importorskip("ray.cluster_utils", reason="pip install 'trajproxy[ray]' (dev has it)")
    with two_nodes() as made:
        yield made


def _running(engine: Any, label: str) -> list[dict[str, Any]]:
    """This run's running containers, each as the engine lists it (one call: nothing to inspect, gone or not)."""
    return list(engine.api.containers(filters={"label": label, "status": "running"}))


def _agents(running: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The agents' containers among them: those in a gate's network (not a gate, pooled or not, nor a grader's)."""
    return [c for c in running if c["HostConfig"]["NetworkMode"].startswith("container:")]


class Watcher:
    """Notes which nodes ran this run's agents, and kills the worker of a node that has one running once both
    nodes have run some: the process that owns that node's sandboxes (its actor) and, with it, its replica."""

    def __init__(self, engine: Any, label: str) -> None:
        self.engine, self.label = engine, label
        self.seen: set[str] = set()
        self.killed: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            agents = _agents(_running(self.engine, self.label))
            self.seen |= {c["Labels"][NODE] for c in agents}
            if self.killed is None and len(self.seen) == 2 and agents:
                victim = agents[0]["Labels"]
                self.killed = victim[NODE]
                os.kill(int(victim["trajproxy.run.pid"]), signal.SIGKILL)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_a_run_without_ray_never_imports_it() -> None:
    """Ray is an optional extra: everything a run uses without --ray loads without it."""
    modules = [
        "sandbox.launch",
        "sandbox.run.command",
        "sandbox.run.runner",
        "sandbox.run.env",
        "sandbox.backends.docker_sandboxes",
    ]
    code = f"import sys; [__import__(m) for m in {modules!r}]; print(sorted(m for m in sys.modules if m == 'ray'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr


@needs_postgres
@pytest.mark.timeout(240)
def test_a_run_spreads_over_two_nodes_and_a_killed_node_loses_no_task(
    cluster: Any, engine: Any, task_image: str, label: str, tmp_path: Path
) -> None:
    [example] = [json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(example) + "\n" for _ in range(TASKS)))
    results, log = tmp_path / "results.jsonl", tmp_path / "run.log"
    assert POSTGRES_URL
    with fresh_schema(POSTGRES_URL) as database:
        command = [
            *(*RUN, str(tasks), "--ray", cluster.address, "--database-url", database, "--label", label),
            *("--agent-cmd", SLOW_AGENT, "--policy", f"scripted:{EXAMPLE / 'solve.script.jsonl'}"),
            *("--concurrency", str(2 * SLOTS), "--results", str(results), "--progress-every-s", "5"),
        ]
        began = time.monotonic()
        watcher = Watcher(engine, label)
        try:
            status = ended(started(command, log), log, timeout_s=200)
        finally:
            watcher.stop()
        took = time.monotonic() - began
        said = log.read_text()
        assert status == 0, said[-4000:]
        assert len(watcher.seen) == 2, f"sandboxes ran on {watcher.seen}, not on both nodes"
        assert watcher.killed is not None, "no node was running a sandbox once both had run some"
        lines = [json.loads(line) for line in results.read_text().splitlines()]
        assert sorted(line["task_id"] for line in lines) == sorted({line["task_id"] for line in lines})
        assert len(lines) == TASKS, said[-4000:]
        assert {(line["status"], line["reward"]) for line in lines} == {("finished", 1.0)}, lines
        episodes = _episodes(database)
    finished = [e for e in episodes if e["status"] == "finished"]
    lost = [e for e in episodes if e["status"] == "failed"]
    assert sorted(e["task_id"] for e in finished) == sorted(line["task_id"] for line in lines)
    assert all(e["rewards"] == [1.0] for e in finished)
    assert lost, "the killed node's running tasks were not recorded"
    assert all(e["rewards"] == [] and "lost" in e["reason"] for e in lost), lost
    assert {e["task_id"] for e in lost} <= {e["task_id"] for e in finished}  # each ran again, elsewhere
    print(f"{TASKS} tasks over 2 nodes, {len(lost)} lost and run again: {took:.1f} s for the run")


def _episodes(database: str) -> list[dict[str, Any]]:
    """Every episode of the run: its status, reason, task and rewards, as the database holds them."""
    engine = sqlalchemy.create_engine(engine_url(database))
    try:
        with engine.connect() as db:
            rows = db.execute(sqlalchemy.text("SELECT id, status, reason, metadata FROM episode")).all()
            rewards = db.execute(sqlalchemy.text("SELECT episode_id, value FROM reward")).all()
    finally:
        engine.dispose()
    return [
        {
            "status": status,
            "reason": reason or "",
            "task_id": json.loads(meta)["task_id"] if isinstance(meta, str) else meta["task_id"],
            "rewards": [value for episode, value in rewards if episode == id_],
        }
        for id_, status, reason, meta in rows
    ]


@needs_postgres
@pytest.mark.timeout(180)
def test_sigterm_stops_a_run_on_the_cluster_as_on_one_machine(
    cluster: Any, engine: Any, task_image: str, label: str, tmp_path: Path
) -> None:
    """SIGTERM mid-run: the episodes are recorded cancelled, every node removes its sandboxes and stops its
    replica, and the run exits 143."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text((EXAMPLE / "tasks.jsonl").read_text() * 2)
    log = tmp_path / "run.log"
    assert POSTGRES_URL
    with fresh_schema(POSTGRES_URL) as database:
        command = [
            *(*RUN, str(tasks), "--ray", cluster.address, "--database-url", database, "--label", label),
            *("--agent-cmd", "sleep 300", "--concurrency", "2"),
        ]
        run = started(command, log)
        wait_for(lambda: len(_agents(_running(engine, label))) == 2 or run.poll() is not None, "two agents", 120)
        run.send_signal(signal.SIGTERM)
        assert ended(run, log) == 143, log.read_text()[-4000:]
        statuses = sorted(episode["status"] for episode in _episodes(database))
    assert statuses == ["cancelled", "cancelled"]
    # the run's own handler heard it, not Ray's native one (its stack dump from inside the handler could abort the run)
    assert "SIGTERM received" not in log.read_text(), log.read_text()[-4000:]
    assert engine.api.containers(all=True, filters={"label": label}) == []
