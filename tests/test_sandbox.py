"""DockerSandboxes on a real engine: the agent reaches trajproxy and nothing else, under its limits."""

from __future__ import annotations

import asyncio
import io
import ipaddress
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from proxy.client import TrainerClient
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.backends.identity import RunIdentity
from sandbox.backends.images import MANAGED
from sandbox.backends.interface import Limits, SandboxError, SandboxSpec
from tests.conftest import mine, output_of

IMAGE = "python:3.11-slim"
TEST_LABEL = "trajproxy.test"  # the conftest `sandboxes` fixture's label for the test's own containers


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


async def call_from_a_box(sandboxes: DockerSandboxes, key: str, timeout_s: float) -> str:
    """An agent's LLM call with `key`, from a sandbox of its own: the reply it got."""
    box = await sandboxes.start(SandboxSpec(IMAGE, env={"OPENAI_API_KEY": key}))
    try:
        result = await box.exec(f"python3 -c '{AGENT_CALL}'", timeout_s=timeout_s)
        assert result.ok, result.output
        return result.output.strip()
    finally:
        await box.stop()


def test_an_agent_in_a_sandbox_talks_to_trajproxy_through_the_gate(
    proxied_trainer: TrainerClient, sandboxes: DockerSandboxes, background: Any
) -> None:
    trainer = proxied_trainer
    episode = trainer.create_episode()

    answer = background(run, call_from_a_box(sandboxes, episode.key, timeout_s=60))
    turn = trainer.next_turns(wait_s=30)[0]
    assert turn.episode_id == episode.id
    assert turn.request["messages"][0]["content"] == "from the box"
    trainer.reply(turn.id, "hello, box")
    assert answer.result(timeout=60) == "hello, box"


@pytest.mark.timeout(300)
def test_more_agents_run_at_once_than_asyncio_has_default_threads(
    proxied_trainer: TrainerClient, sandboxes: DockerSandboxes, background: Any
) -> None:
    """A running agent's exec holds a thread for its whole run: every one of more agents than asyncio's default
    pool has threads must be running at once, each parked at trajproxy, before any of them is answered."""
    trainer = proxied_trainer
    count = min(32, (os.cpu_count() or 1) + 4) + 2  # asyncio's default pool size, and then some
    episodes = [trainer.create_episode() for _ in range(count)]

    async def scenario() -> list[str]:
        calls = (call_from_a_box(sandboxes, episode.key, timeout_s=240) for episode in episodes)
        return list(await asyncio.gather(*calls))

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
    ordinary = output_of(
        engine, IMAGE, ["sh", "-c", f"{probe} {gateway} {port}"], labels=sandboxes.labels
    )  # labelled as the test's own, so that the fixture removes it if the test stops early
    assert ordinary.startswith("connected"), ordinary

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


# A gate image whose python3 is a shell script: WRAPPER runs in its place (PYTHON in it: the real one).
GATE_DOCKERFILE = """FROM python:3.11-slim
ARG WRAPPER
RUN at=$(command -v python3) && real=$(readlink -f "$at") && rm "$at" \\
    && printf '#!/bin/sh\\n%s\\n' "$WRAPPER" | sed "s|PYTHON|$real|" >"$at" && chmod +x "$at"
"""
SLOW_START_S = 3


def gate_image(engine: Any, name: str, wrapper: str) -> str:
    tag = f"trajproxy-test/{name}-gate"
    dockerfile = io.BytesIO(GATE_DOCKERFILE.encode())
    engine.images.build(fileobj=dockerfile, tag=tag, buildargs={"WRAPPER": wrapper}, forcerm=True)
    return tag


@pytest.fixture(scope="module")
def slow_gate(engine: Any) -> str:
    """A gate that takes seconds to start relaying, as one does on an engine under load."""
    return gate_image(engine, "slow", f'sleep {SLOW_START_S}; exec PYTHON "$@"')


def like(sandboxes: DockerSandboxes, socket_dir: str, **options: Any) -> DockerSandboxes:
    """Other sandboxes with the test's labels, so the `sandboxes` fixture checks that they leave nothing."""
    return DockerSandboxes(socket_dir, labels={TEST_LABEL: sandboxes.labels[TEST_LABEL]}, **options)


def test_the_agents_first_call_finds_its_gate_relaying_however_slow_the_gate(
    sandboxes: DockerSandboxes, socket_dir: str, slow_gate: str
) -> None:
    """An agent may call trajproxy the moment it starts: a sandbox is handed over only once its gate relays
    (a running gate container is not yet a listening relay; before the fix, this call was refused)."""
    slow = like(sandboxes, socket_dir, gate_image=slow_gate)

    async def scenario() -> tuple[str, float]:
        started = time.monotonic()
        box = await slow.start(SandboxSpec(IMAGE))
        took_s = time.monotonic() - started
        try:
            return (await box.exec(f"python3 -c '{CONNECT}' 127.0.0.1 {slow.proxy_port}", timeout_s=30)).output, took_s
        finally:
            await box.stop()

    probe, took_s = run(scenario())
    assert probe.startswith("connected"), probe
    assert took_s >= SLOW_START_S  # it did wait for the gate


def test_pooled_gates_are_started_ahead_and_each_relays_for_the_sandbox_that_takes_it(
    sandboxes: DockerSandboxes, socket_dir: str, engine: Any
) -> None:
    """With a pool, gates start before any sandbox asks; a start takes a relaying one (its agent joins that gate's
    network), the pool is refilled, and `close` removes what is left (the fixture checks nothing remains)."""
    pooled = like(sandboxes, socket_dir, gate_pool=2)
    mine_only = {"label": [f"{name}={value}" for name, value in pooled.labels.items()]}

    async def scenario() -> tuple[set[str], list[str], list[str], int]:
        await pooled.warm()
        ready = {c.id for c in engine.containers.list(filters=mine_only)}
        boxes = await asyncio.gather(*(pooled.start(SandboxSpec(IMAGE)) for _ in range(2)))
        try:
            joined = [engine.containers.get(box.id).attrs["HostConfig"]["NetworkMode"] for box in boxes]
            probes = [
                (await box.exec(f"python3 -c '{CONNECT}' 127.0.0.1 {pooled.proxy_port}", timeout_s=30)).output
                for box in boxes
            ]
        finally:
            for box in boxes:
                await box.stop()
        for _ in range(300):  # the refills, started on the pool's threads as each gate was taken
            if (refilled := len(engine.containers.list(filters=mine_only))) == 2:
                break
            await asyncio.sleep(0.1)
        await pooled.close()
        return ready, joined, probes, refilled

    ready, joined, probes, refilled = run(scenario())
    assert len(ready) == 2
    assert sorted(joined) == sorted(f"container:{gate}" for gate in ready)
    assert all(probe.startswith("connected") for probe in probes), probes
    assert refilled == 2


@pytest.mark.timeout(120)
def test_many_agents_started_at_once_never_have_their_first_call_refused(
    sandboxes: DockerSandboxes, socket_dir: str
) -> None:
    """The same with real gates, many at once on a busy engine (before the fix, about 1 in 8 was refused)."""

    async def one() -> str:
        box = await sandboxes.start(SandboxSpec(IMAGE))
        try:
            return (await box.exec(f"python3 -c '{CONNECT}' 127.0.0.1 {sandboxes.proxy_port}", timeout_s=30)).output
        finally:
            await box.stop()

    async def scenario() -> list[str]:
        return list(await asyncio.gather(*(one() for _ in range(12))))

    probes = run(scenario())
    assert [probe for probe in probes if not probe.startswith("connected")] == []


def test_a_gate_that_cannot_relay_is_a_clear_error_and_leaves_nothing(
    sandboxes: DockerSandboxes, socket_dir: str, engine: Any, slow_gate: str
) -> None:
    broken = gate_image(engine, "broken", "echo no python here >&2; exit 3")
    with pytest.raises(SandboxError, match=r"gate exited .*no python here"):
        run(like(sandboxes, socket_dir, gate_image=broken).start(SandboxSpec(IMAGE)))
    with pytest.raises(SandboxError, match=r"not relaying after 0\.5 s"):
        run(like(sandboxes, socket_dir, gate_image=slow_gate, gate_timeout_s=0.5).start(SandboxSpec(IMAGE)))
    assert not engine.containers.list(all=True, filters={"label": mine(sandboxes)})


def test_a_start_cancelled_midway_leaves_nothing(
    sandboxes: DockerSandboxes, socket_dir: str, engine: Any, slow_gate: str
) -> None:
    """Ctrl-C while a sandbox starts: the docker calls already under way finish on their thread, and what they
    made is removed before the cancellation goes on."""
    slow = like(sandboxes, socket_dir, gate_image=slow_gate)

    async def scenario() -> None:
        starting = asyncio.create_task(slow.start(SandboxSpec(IMAGE)))
        deadline = time.monotonic() + 30
        while len(engine.containers.list(filters={"label": mine(slow)})) < 2:  # the gate and the agent's box
            assert time.monotonic() < deadline, "the sandbox never started"
            await asyncio.sleep(0.1)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting

    run(scenario())
    assert not engine.containers.list(all=True, filters={"label": mine(slow)})


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


def exited_run() -> RunIdentity:
    """The identity of a run whose process has exited (a crash): a real process, started and killed."""
    process = subprocess.Popen(["sleep", "60"])
    try:
        identity = RunIdentity.of_process(process.pid)
    finally:
        process.kill()
        process.wait()
    assert identity.started, "no start time read from /proc"
    return identity


def test_a_run_is_alive_while_its_process_runs_and_never_after() -> None:
    here = RunIdentity.current()
    assert here.alive()
    assert RunIdentity.from_labels(here.labels()) == here
    assert RunIdentity.from_labels({MANAGED: "1"}) is None
    gone = exited_run()
    assert not gone.alive()
    assert not replace(here, started=str(int(here.started) + 1)).alive()  # this pid, reused by another process
    assert not replace(here, boot="an-earlier-boot").alive()  # the machine restarted since
    assert gone.why_kept(here) is None
    assert here.why_kept(here) == f"of a live run (pid {os.getpid()})"
    assert replace(gone, owner="someone").why_kept(here) == "of another owner (uid someone)"
    assert replace(gone, host="elsewhere").why_kept(here) == "made on another host (elsewhere)"


@pytest.mark.serial
def test_prune_removes_only_the_sandboxes_of_runs_that_are_gone(
    sandboxes: DockerSandboxes, engine: Any, socket_dir: str
) -> None:
    """Other runs share the engine: a live run's sandboxes (this process's), another owner's and another host's
    are left; those of a run of this owner on this host that has exited (or whose pid was reused) go."""
    ours = {TEST_LABEL: sandboxes.labels[TEST_LABEL]}
    gone = exited_run()
    here = sandboxes.run
    made_by = {
        "crashed": gone,
        "reused pid": replace(here, started=str(int(here.started) + 1)),
        "other owner": replace(gone, owner=str(os.getuid() + 1)),
        "other host": replace(gone, host="elsewhere"),
    }
    try:

        async def scenario() -> dict[str, list[str]]:
            await sandboxes.start(SandboxSpec(IMAGE, proxy=False))  # this live run's, forgotten for now
            ids = {}
            for name, run_by in made_by.items():
                factory = DockerSandboxes(socket_dir, labels=ours, run=run_by)
                await factory.start(SandboxSpec(IMAGE, proxy=name == "crashed"))  # with its gate: 2 containers
                ids[name] = [c.id for c in engine.containers.list(filters={"label": mine(factory)})]
            return ids

        ids = run(scenario())
        older = engine.containers.run(IMAGE, ["sleep", "300"], detach=True, labels={MANAGED: "1", **ours})
        pruned = run(sandboxes.prune())
        assert len(ids["crashed"]) == 2
        assert sorted(pruned.removed) == sorted(ids["crashed"] + ids["reused pid"])
        [live] = engine.containers.list(filters={"label": mine(sandboxes)})
        assert pruned.kept == {
            live.id: f"of a live run (pid {os.getpid()})",
            ids["other owner"][0]: f"of another owner (uid {os.getuid() + 1})",
            ids["other host"][0]: "made on another host (elsewhere)",
            older.id: "with no run labels (made by an older trajproxy)",
        }
        left = {c.id for c in engine.containers.list(all=True, filters={"label": f"{TEST_LABEL}={ours[TEST_LABEL]}"})}
        assert left == set(pruned.kept)
    finally:
        for container in engine.containers.list(all=True, filters={"label": f"{TEST_LABEL}={ours[TEST_LABEL]}"}):
            container.remove(force=True)


def test_the_sandbox_socket_serves_agents_but_never_the_trainer_api(
    proxied_trainer: TrainerClient, socket_dir: str
) -> None:
    """No token is configured, yet a sandboxed agent cannot pull or answer turns through its gate."""
    trainer = proxied_trainer
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
