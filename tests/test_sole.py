"""One process per SQLite database: a second `trajproxy serve` or `trajproxy run` on a file another process serves
is refused at start in one line, and the one serving carries on."""

from __future__ import annotations

import subprocess
from typing import Any

import httpx
import pytest

from proxy.client import TrainerClient
from testkit.tasks import EXAMPLE
from tests.test_cli import clean_env, free_port, trajproxy_script


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_second_process_on_a_served_sqlite_file_is_refused(
    server: Any, trainer: TrainerClient, database_url: str
) -> None:
    episode = trainer.create_episode(task="kept")
    tries = {
        "serve": [trajproxy_script(), "serve", "--port", str(free_port()), "--database-url", database_url],
        "run": [
            *(trajproxy_script(), "run", str(EXAMPLE / "tasks.jsonl"), "--agent-cmd", "true"),
            *("--port", "0", "--database-url", database_url),
        ],
    }
    for command in tries.values():
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=clean_env())
        assert done.returncode != 0
        assert "another trajproxy process is serving the SQLite database" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200  # the first never noticed
    assert trainer.episode(episode.id).task == "kept"
