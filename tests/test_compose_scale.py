"""`docker compose --profile scale up`: three trajproxy replicas on one Postgres behind HAProxy; agents spread over
them, a trainer through the balancer answers every one, a stopped replica costs nothing, and the sandboxes' door
(the balancer's Unix socket) serves agents only."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from proxy.client import TrainerClient
from tests.test_compose import ROOT, TOKEN, free_port, healthy

REPLICAS = ("trajproxy-1", "trajproxy-2", "trajproxy-3")  # the balancer's names for them (deploy/haproxy/compose.cfg)


@dataclass(frozen=True)
class Scale:
    command: list[str]
    env: dict[str, str]
    url: str  # the balancer
    sockets_volume: str  # the balancer's socket, for sandboxes

    def compose(self, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.command, *args], env=self.env, capture_output=True, text=True, timeout=timeout_s)

    def servers(self) -> dict[str, dict[str, str]]:
        """HAProxy's own view of the replicas (its stats CSV, read inside the balancer's container)."""
        read = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8404/stats;csv').read().decode())"
        done = self.compose("exec", "-T", "balancer", "python3", "-c", read, timeout_s=60)
        assert done.returncode == 0, done.stderr
        rows = csv.DictReader(io.StringIO(done.stdout.lstrip("# ")))
        return {row["svname"]: row for row in rows if row["pxname"] == "replicas" and row["svname"] in REPLICAS}


@pytest.fixture
def scale(engine: Any) -> Iterator[Scale]:
    port, balancer_port = free_port(), free_port()
    project = f"trajproxy-scale-test-{balancer_port}"
    env = {
        **os.environ,
        "TRAJPROXY_PORT": str(port),
        "TRAJPROXY_BALANCER_PORT": str(balancer_port),
        "TRAJPROXY_TRAINER_TOKEN": TOKEN,
        "TRAJPROXY_PUBLIC_URL": f"http://127.0.0.1:{balancer_port}",  # agents are handed the balancer's URL
        # volumes of its own, by name (gates mount them through the host's engine): another run may be up
        "TRAJPROXY_SOCKETS_VOLUME": f"{project}-sockets",
        "TRAJPROXY_SCALE_SOCKETS_VOLUME": f"{project}-scale-sockets",
    }
    command = ["docker", "compose", "--project-name", project, "--file", str(ROOT / "docker-compose.yml")]
    command += ["--profile", "scale"]
    try:
        yield Scale(command, env, f"http://127.0.0.1:{balancer_port}", f"{project}-scale-sockets")
    finally:
        down = [*command, "--profile", "demo", "down", "--volumes", "--remove-orphans"]
        subprocess.run(down, env=env, capture_output=True, timeout=300)


def ask(episode_env: dict[str, str], text: str, answers: dict[str, str]) -> None:
    with openai.OpenAI(
        base_url=episode_env["OPENAI_BASE_URL"], api_key=episode_env["OPENAI_API_KEY"], max_retries=0, timeout=120
    ) as client:
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": text}])
    answers[text] = reply.choices[0].message.content or ""


def answer_all(trainer: TrainerClient, wanted: int) -> None:
    """Answer `wanted` turns, each with "re: " and its text."""
    answered = 0
    deadline = time.monotonic() + 120
    while answered < wanted:
        assert time.monotonic() < deadline, f"only {answered} of {wanted} calls reached the trainer"
        for turn in trainer.next_turns(max=8, wait_s=2):
            trainer.reply(turn.id, content=f"re: {turn.request['messages'][-1]['content']}")
            answered += 1


def agents_answered(trainer: TrainerClient, texts: list[str], until_parked: Any = None) -> dict[str, str]:
    """One openai SDK agent per text, all calling at once through the balancer; the trainer answers them."""
    answers: dict[str, str] = {}
    episodes = [trainer.create_episode(task=text) for text in texts]
    threads = [threading.Thread(target=ask, args=(e.env, t, answers)) for e, t in zip(episodes, texts, strict=True)]
    for thread in threads:
        thread.start()
    if until_parked is not None:
        until_parked()
    answer_all(trainer, len(texts))
    for thread in threads:
        thread.join(120)
    return answers


@pytest.mark.timeout(2400)
def test_three_replicas_behind_the_balancer_share_the_queue(scale: Scale) -> None:
    up = scale.compose("up", "--detach", "--build", timeout_s=1200)
    assert up.returncode == 0, up.stderr[-3000:]
    healthy(scale.url, 180)
    assert httpx.get(f"{scale.url}/api/episodes").status_code == 401  # the trainer token is in force
    with TrainerClient(scale.url, token=TOKEN) as trainer:
        # Three calls parked at once: the balancer (least connections) puts one on each replica; the trainer, through
        # the balancer too, pulls and answers all three, whichever replica holds each.
        def each_replica_holds_one() -> None:
            deadline = time.monotonic() + 60
            while not all(int(server["scur"]) >= 1 for server in scale.servers().values()):
                assert time.monotonic() < deadline, f"the calls were not spread: {scale.servers()}"
                time.sleep(0.5)

        texts = ["first", "second", "third"]
        answers = agents_answered(trainer, texts, until_parked=each_replica_holds_one)
        assert answers == {text: f"re: {text}" for text in texts}

        # A replica gone: the balancer sees it down and the other two carry on.
        stopped = scale.compose("stop", "trajproxy-3", timeout_s=120)
        assert stopped.returncode == 0, stopped.stderr
        deadline = time.monotonic() + 60
        while scale.servers()["trajproxy-3"]["status"] != "DOWN":
            assert time.monotonic() < deadline, "the balancer never saw trajproxy-3 go down"
            time.sleep(0.5)
        texts = [f"after the stop {n}" for n in range(4)]
        assert agents_answered(trainer, texts) == {text: f"re: {text}" for text in texts}
        turns = [t for e in trainer.episodes(limit=100).episodes for t in trainer.trajectory(e.id).turns]
        assert sorted(turn.status for turn in turns) == ["answered"] * 7  # one turn per call, none doubled

        # The sandboxes' door: on the balancer's socket, agents' routes are served and the trainer API is not.
        probe = (
            "import http.client, socket, sys\n"
            "class Unix(http.client.HTTPConnection):\n"
            "    def connect(self):\n"
            "        self.sock = socket.socket(socket.AF_UNIX); self.sock.connect('/run/balancer/proxy.sock')\n"
            "for path in ('/health', '/api/episodes'):\n"
            "    c = Unix('localhost'); c.request('GET', path, headers={'authorization': 'Bearer ' + sys.argv[1]})\n"
            "    print(path, c.getresponse().status)\n"
        )
        mount = f"{scale.sockets_volume}:/run/balancer"
        door = subprocess.run(
            [
                "docker",
                "run",
                "--rm",
                "--network",
                "none",
                "-v",
                mount,
                "python:3.11-slim",
                "python3",
                "-c",
                probe,
                TOKEN,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert door.returncode == 0, door.stderr
        assert door.stdout.split("\n")[:2] == ["/health 200", "/api/episodes 403"]

        # `trajproxy run --proxy-url` through the balancer, its sandboxes through the balancer's socket: the demo's
        # episode ends with its reward.
        through = ["-e", "TRAJPROXY_URL=http://balancer:8080", "-e", f"TRAJPROXY_SOCKETS_VOLUME={scale.sockets_volume}"]
        demo = scale.compose("--profile", "demo", "run", "--rm", *through, "demo", timeout_s=1200)
        output = demo.stdout + demo.stderr
        assert demo.returncode == 0, output[-3000:]
        assert "1 task(s) run, 0 rejected, mean reward 1.000" in output
