"""DockerSandboxes on a real engine: the agent reaches trajproxy and nothing else, under its limits."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from proxy.client import TrainerClient
from sandbox.containers import Limits, SandboxError, SandboxSpec
from sandbox.docker_sandbox import DockerSandboxes
from tests.conftest import mine

IMAGE = "python:3.11-slim"


@pytest.fixture
def database_url(tmp_path: Any) -> str:
    """Sandboxes do not care where turns are stored: SQLite only (the store has its own contract suite)."""
    return f"sqlite:///{tmp_path}/trajproxy.db"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


AGENT_CALL = """
import json, os, urllib.request
request = urllib.request.Request(
    "http://127.0.0.1:8000/v1/chat/completions",
    data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "from the box"}]}).encode(),
    headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"},
)
print(json.load(urllib.request.urlopen(request, timeout=30))["choices"][0]["message"]["content"])
"""


def test_an_agent_in_a_sandbox_talks_to_trajproxy_through_the_gate(
    proxied: Any, sandboxes: DockerSandboxes, background: Any
) -> None:
    trainer = TrainerClient(proxied.url, proxied.token)
    episode = trainer.create_episode()

    async def scenario() -> str:
        box = await sandboxes.start(SandboxSpec(IMAGE, env={"OPENAI_API_KEY": episode.key}))
        try:
            result = await box.exec(f"python3 -c '{AGENT_CALL}'", timeout_s=60)
            assert result.ok, result.output
            return result.output.strip()
        finally:
            await box.stop()

    answer = background(run, scenario())
    turn = trainer.next_turns(wait_s=30)[0]
    assert turn.episode_id == episode.id
    assert turn.request["messages"][0]["content"] == "from the box"
    trainer.reply(turn.id, "hello, box")
    assert answer.result(timeout=60) == "hello, box"


@pytest.mark.timeout(300)
def test_more_agents_run_at_once_than_asyncio_has_default_threads(
    proxied: Any, sandboxes: DockerSandboxes, background: Any
) -> None:
    """A running agent's exec holds a thread for its whole run: every one of more agents than asyncio's default
    pool has threads must be running at once, each parked at trajproxy, before any of them is answered."""
    trainer = TrainerClient(proxied.url, proxied.token)
    count = min(32, (os.cpu_count() or 1) + 4) + 2  # asyncio's default pool size, and then some
    episodes = [trainer.create_episode() for _ in range(count)]

    async def one(key: str) -> str:
        box = await sandboxes.start(SandboxSpec(IMAGE, env={"OPENAI_API_KEY": key}))
        try:
            result = await box.exec(f"python3 -c '{AGENT_CALL}'", timeout_s=240)
            assert result.ok, result.output
            return result.output.strip()
        finally:
            await box.stop()

    async def scenario() -> list[str]:
        return list(await asyncio.gather(*(one(episode.key) for episode in episodes)))

    answers = background(run, scenario())
    parked: list[Any] = []
    deadline = time.monotonic() + 240
    while len(parked) < count and time.monotonic() < deadline:
        if answers.done():  # the agents gave up (or failed to start): say why
            answers.result()
        parked += trainer.next_turns(max=count, wait_s=5)
    assert len(parked) == count, f"only {len(parked)} of {count} agents were running at once"
    for turn in parked:
        trainer.reply(turn.id, f"hello, {turn.episode_id}")
    assert sorted(answers.result(timeout=120)) == sorted(f"hello, {episode.id}" for episode in episodes)


CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("connected")
except OSError as e:
    print("refused", e)
"""


@pytest.fixture
def host_listener(engine: Any) -> Iterator[tuple[str, int]]:
    """A TCP service on every address of the host, and the bridge gateway address containers see it at."""
    server = socket.create_server(("0.0.0.0", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                server.accept()[0].close()
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    config = engine.networks.get("bridge").attrs["IPAM"]["Config"][0]
    gateway = config.get("Gateway") or str(next(ipaddress.ip_network(config["Subnet"]).hosts()))
    yield gateway, server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


def test_the_sandbox_reaches_nothing_but_the_proxy(
    proxied: Any, sandboxes: DockerSandboxes, engine: Any, host_listener: tuple[str, int]
) -> None:
    gateway, port = host_listener
    probe = f"python3 -c '{CONNECT}'"
    # Control: an ordinary container on Docker's bridge does reach the host service.
    ordinary = engine.containers.run(IMAGE, ["sh", "-c", f"{probe} {gateway} {port}"], remove=True)
    assert ordinary.decode().startswith("connected")

    async def scenario() -> None:
        box = await sandboxes.start(SandboxSpec(IMAGE))
        try:
            host = await box.exec(f"{probe} {gateway} {port}", timeout_s=30)
            assert host.output.startswith("refused"), host.output
            # A documentation address (RFC 5737): with no route at all, no packet ever leaves the namespace.
            outside = await box.exec(f"{probe} 192.0.2.1 80", timeout_s=30)
            assert outside.output.startswith("refused"), outside.output
            interfaces = await box.exec("cat /proc/net/dev", timeout_s=10)
            assert [line.split(":")[0].strip() for line in interfaces.output.splitlines()[2:]] == ["lo"]
            proxy = await box.exec(f"{probe} 127.0.0.1 {sandboxes.proxy_port}", timeout_s=30)
            assert proxy.output.startswith("connected"), proxy.output
        finally:
            await box.stop()

    run(scenario())


# The limits as the kernel enforces them, from cgroup v2 or v1 files: memory bytes, pids, "quota period".
CGROUP_LIMITS = """cd /sys/fs/cgroup
if [ -f memory.max ]; then cat memory.max pids.max cpu.max
else cat memory/memory.limit_in_bytes pids/pids.max; echo "$(cat cpu/cpu.cfs_quota_us) $(cat cpu/cpu.cfs_period_us)"
fi"""


def test_limits_and_hardening_are_in_force(sandboxes: DockerSandboxes) -> None:
    limits = Limits(cpus=0.5, memory_bytes=256 * 1024**2, pids=64)

    async def scenario() -> None:
        box = await sandboxes.start(SandboxSpec(IMAGE, limits=limits, proxy=False))
        try:
            cgroup = await box.exec(CGROUP_LIMITS, timeout_s=10)
            memory, pids, cpu = cgroup.output.splitlines()
            assert int(memory) == 256 * 1024**2
            assert int(pids) == 64
            quota, period = cpu.split()
            assert int(quota) / int(period) == pytest.approx(0.5)
            status = await box.exec("grep -E '^(CapEff|NoNewPrivs)' /proc/self/status", timeout_s=10)
            assert "CapEff:\t0000000000000000" in status.output
            assert "NoNewPrivs:\t1" in status.output
            fork_bomb = await box.exec("for i in $(seq 100); do sleep 5 & done; wait", timeout_s=20)
            assert "fork" in fork_bomb.output.lower(), fork_bomb.output
        finally:
            await box.stop()

    run(scenario())


def test_exec_timeouts_and_files(sandboxes: DockerSandboxes) -> None:
    async def scenario() -> None:
        box = await sandboxes.start(SandboxSpec(IMAGE, workdir="/tmp", proxy=False))
        try:
            slow = await box.exec("sleep 30", timeout_s=1)
            assert slow.timed_out and not slow.ok
            await box.upload("/tmp/task/notes.txt", "héllo\n".encode())
            assert await box.download("/tmp/task/notes.txt") == "héllo\n".encode()
            listed = await box.exec("pwd && cat task/notes.txt && exit 3", timeout_s=10)
            assert (listed.exit_code, listed.output) == (3, "/tmp\nhéllo\n")
            with pytest.raises(SandboxError):
                await box.download("/tmp/missing")
        finally:
            await box.stop()

    run(scenario())


def test_a_missing_image_is_a_clear_error_and_leaves_nothing(sandboxes: DockerSandboxes, engine: Any) -> None:
    with pytest.raises(SandboxError, match="not found"):
        run(sandboxes.start(SandboxSpec("trajproxy-test/no-such-image:404")))
    assert not engine.containers.list(all=True, filters={"label": mine(sandboxes)})


def test_prune_removes_what_was_left_behind(sandboxes: DockerSandboxes, engine: Any) -> None:
    async def scenario() -> int:
        await sandboxes.start(SandboxSpec(IMAGE, proxy=True))  # forgotten: never stopped
        await sandboxes.start(SandboxSpec(IMAGE, proxy=False))
        return await sandboxes.prune()

    assert run(scenario()) == 3  # two agents and one gate
    assert not engine.containers.list(all=True, filters={"label": mine(sandboxes)})


def test_the_sandbox_socket_serves_agents_but_never_the_trainer_api(proxied: Any, socket_dir: str) -> None:
    """No token is configured, yet a sandboxed agent cannot pull or answer turns through its gate."""
    trainer = TrainerClient(proxied.url, proxied.token)
    episode = trainer.create_episode()
    with httpx.Client(transport=httpx.HTTPTransport(uds=f"{socket_dir}/proxy.sock"), base_url="http://box") as box:
        assert box.get("/health").json()["status"] == "ok"
        for method, path in [("GET", "/api/turns/next"), ("GET", "/api/episodes"), ("POST", "/api/episodes")]:
            refused = box.request(method, path, json={})
            assert refused.status_code == 403, path
            assert "sandbox socket" in refused.json()["error"]["message"]
        unauthenticated = box.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert unauthenticated.status_code == 401
    assert trainer.episode(episode.id).status == "pending"
