"""`trajproxy run` beside a `trajproxy serve` of the same database, as the README has a new user do: the run goes
through the server that holds the database (found by the file it keeps beside it) instead of refusing it; a database
held by a process it cannot go through is refused at once, before the agent's bundle is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.client import TrainerClient
from proxy.storage.database_lock import DatabaseLock
from testkit.tasks import EXAMPLE
from tests.test_cli import clean_env, free_port, run_cli, serving


@pytest.mark.timeout(180)
def test_a_run_beside_a_serve_of_its_database_goes_through_it(tmp_path: Path, task_image: str, label: str) -> None:
    token, port = "beside-serve-token", free_port()
    env = clean_env(TRAJPROXY_TRAINER_TOKEN=token)
    kept = tmp_path / "trajproxy.db-serving.json"
    with serving(["--port", str(port)], tmp_path, env) as served:  # ./trajproxy.db, as the README's
        served.wait_healthy(port)
        said = json.loads(kept.read_text())
        assert said["url"] == f"http://127.0.0.1:{port}" and said["pid"] == served.process.pid
        assert Path(said["socket_path"]).is_socket() and token not in kept.read_text()
        done = run_cli(["run", str(EXAMPLE / "tasks.jsonl"), "--agent-cmd", "true", "--label", label], tmp_path, env)
        assert done.returncode == 0, done.stderr
        assert f"http://127.0.0.1:{port} (pid {served.process.pid}) serves that database already" in done.stderr
        with TrainerClient(f"http://127.0.0.1:{port}", token) as trainer:
            [episode] = trainer.episodes().episodes
        assert episode.status == "finished", episode
        assert served.stop() in (0, -15)
    assert not kept.exists()  # the server that said so is gone: so is what it said


def test_a_database_held_by_another_process_is_refused_before_the_agent_is_built(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/held.db"
    held = DatabaseLock(url)
    held.acquire()  # a process serving it that says nothing of where (an embedded trajproxy, say)
    try:
        bundles = tmp_path / "bundles"
        command = ["run", str(EXAMPLE / "tasks.jsonl"), "--agent", "minimal", "--bundles", str(bundles)]
        done = run_cli([*command, "--database-url", url, "--port", str(free_port())], tmp_path)
    finally:
        held.release()
    said = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(said) == 1 and "another trajproxy process is serving the SQLite database" in said[0], said
    assert not bundles.exists() or not any(bundles.iterdir()), "the agent's bundle was built before the refusal"
