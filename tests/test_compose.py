"""`docker compose up` from the checkout: trajproxy on Postgres, and the demo profile's episode ends with a reward."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.client import TrainerClient

ROOT = Path(__file__).parent.parent
TOKEN = "compose-test-token"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def healthy(url: str, timeout_s: float) -> None:
    """Wait until `url`/health answers 200 (the service in compose is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} never became healthy"
        time.sleep(1)


@pytest.fixture
def compose(engine: Any) -> Iterator[tuple[list[str], str, dict[str, str]]]:
    port = free_port()
    env = {
        **os.environ,
        "TRAJPROXY_PORT": str(port),
        "TRAJPROXY_TRAINER_TOKEN": TOKEN,
        "TRAJPROXY_SOCKETS_VOLUME": f"trajproxy-test-{port}-sockets",  # its own: another run may be up
    }
    command = [
        "docker",
        "compose",
        "--project-name",
        f"trajproxy-test-{port}",
        "--file",
        str(ROOT / "docker-compose.yml"),
    ]
    try:
        yield command, f"http://127.0.0.1:{port}", env
    finally:
        subprocess.run(
            [*command, "--profile", "demo", "down", "--volumes", "--remove-orphans"],
            env=env,
            capture_output=True,
            timeout=300,
        )


@pytest.mark.timeout(1500)
def test_compose_up_serves_trajproxy_on_postgres_and_the_demo_earns_a_reward(
    compose: tuple[list[str], str, dict[str, str]],
) -> None:
    command, url, env = compose
    up = subprocess.run(
        [*command, "up", "--detach", "--build", "trajproxy"], env=env, capture_output=True, text=True, timeout=1200
    )
    assert up.returncode == 0, up.stderr[-3000:]
    healthy(url, 120)

    assert httpx.get(f"{url}/api/episodes").status_code == 401  # the trainer token is in force
    with TrainerClient(url, token=TOKEN) as trainer:
        probe = trainer.create_episode(task="compose probe")
        assert trainer.episode(probe.id).status == "pending"

        demo = subprocess.run(
            [*command, "--profile", "demo", "run", "--rm", "demo"],
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        output = demo.stdout + demo.stderr
        assert demo.returncode == 0, output[-3000:]
        assert "1 task(s) run, 0 rejected, mean reward 1.000" in output
        finished = trainer.episodes(status="finished").episodes
        assert len(finished) == 1
        [reward] = trainer.trajectory(finished[0].id).rewards
        assert (reward.value, reward.source) == (1.0, "grader")
