"""Shared fixtures: a live trajproxy on a free port, over SQLite or a real Postgres, and a trainer client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import pytest
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from proxy.app import create_app
from proxy.client import TrainerClient
from proxy.servers.front import Front, front
from proxy.servers.limits import Limits
from proxy.servers.sockets import LISTEN_BACKLOG
from proxy.settings import Settings
from proxy.trainer_token import kept_token
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.tasks.read import read_tasks
from sandbox.tasks.task import Task
from testkit.databases import fresh_schema
from testkit.tasks import EXAMPLE, ROOT
from testkit.vllm_server import VllmServer, build_tiny_model, copy_model, vllm_server
from tests.lanes import LANES, Lane

POSTGRES_URL = os.environ.get("TRAJPROXY_TEST_POSTGRES_URL")

# The HTTP server in front of every live trajproxy the tests start (`serve_app`, and `trajproxy serve` or `run`
# through clean_env): the default unless TRAJPROXY_TEST_SERVER names the other. CI runs the whole suite on the
# default, then the files below again on the other server: what a server does beneath the app (disconnects, SSE
# keep-alives, keep-alive connections, WebSocket, the Unix socket, Ctrl-C and SIGTERM while calls are parked, what
# reaches the log), on SQLite only: about 95 tests.
TEST_SERVER: str = os.environ.get("TRAJPROXY_TEST_SERVER") or Settings.model_fields["server"].default
OTHER_SERVER = {"granian": "uvicorn", "uvicorn": "granian"}[Settings.model_fields["server"].default]
ON_BOTH_SERVERS = (
    "tests/test_chat_sdk.py",
    "tests/test_faults.py",
    "tests/test_logs.py",
    "tests/test_bad_bodies.py",
    "tests/test_delivery.py",
    "tests/test_stream.py",
    "tests/test_sandbox.py::test_the_sandbox_socket_serves_agents_but_never_the_trainer_api",
    "tests/test_socket_door.py",
    "tests/test_stalls.py",
    # `trajproxy serve`'s own: what it serves, its socket's backlog and sends, what it imports (the rest of
    # test_cli.py is settings and messages, the same before either server starts)
    "tests/test_cli.py::test_serve_answers_health_on_a_sqlite_file_in_wal_mode",
    "tests/test_cli.py::test_the_listening_socket_queues_a_burst_of_connections",
    "tests/test_cli.py::test_a_public_address_with_a_trainer_token_starts_and_guards_the_trainer_api",
    "tests/test_cli.py::test_no_litellm_token_encoding_psycopg_or_aiohttp_is_loaded_when_a_server_on_sqlite_starts",
    "tests/test_cli.py::test_connections_to_the_served_socket_send_without_delay",
    "tests/test_launch.py::test_a_stopping_signal_cancels_the_run_and_removes_every_container",
    "tests/test_shutdown.py",
    "tests/test_floods.py",
    "tests/test_forwarded.py",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "settings(**overrides): trajproxy settings for the `server` fixture")
    config.addinivalue_line("markers", "conformance: a preset solving the task in a bare image (.ci/run's own stage)")
    config.addinivalue_line(
        "markers",
        "serial: runs alone (.ci/run runs these after the tests that run a few at once): it leaves a gone run's "
        "containers for a prune to find, which any other trajproxy run on the engine would prune first, or it kills "
        "a Ray node on a timetable that other tests' load would upset",
    )
    # The token file servers keep a generated trainer token in: one of the test run's own, never the user's, made
    # now so that a client built before its `trajproxy serve` has started already finds the token.
    token_file = Path(tempfile.mkdtemp(prefix="tp-token")) / "trainer-token"
    os.environ["TRAJPROXY_TRAINER_TOKEN_FILE"] = str(token_file)
    os.environ.pop("TRAJPROXY_TRAINER_TOKEN", None)
    os.environ["TRAJPROXY_SERVER"] = TEST_SERVER  # for `trajproxy run`'s embedded proxy too, in or out of process
    kept_token(token_file)
    config.pluginmanager.import_plugin("tests.tls_context")  # one TLS context for the tests' thousands of clients
    config.pluginmanager.import_plugin("tests.skips")  # under CI, a skip nobody expected fails the run
    config.pluginmanager.import_plugin("tests.placement")  # under xdist: a file per worker, and vLLM's tests on one
    config.pluginmanager.import_plugin("tests.built_envs")  # the `venvs` mark: tests on what .ci/run builds


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """A fresh, empty database: a SQLite file, or a schema of its own on the test Postgres server."""
    with fresh_database(request.param, tmp_path) as url:
        yield url


@contextlib.contextmanager
def fresh_database(kind: str, folder: Any) -> Iterator[str]:
    """A fresh, empty database of this kind: "sqlite" (a file in `folder`) or "postgres" (a schema of its own on the
    test Postgres server; the test is skipped where there is none, and fails under CI)."""
    if kind == "sqlite":
        yield f"sqlite:///{folder}/trajproxy.db"
        return
    if not POSTGRES_URL:
        if os.environ.get("CI"):
            pytest.fail("CI must run the Postgres tests: .ci/run sets TRAJPROXY_TEST_POSTGRES_URL")
        pytest.skip("no Postgres server: set TRAJPROXY_TEST_POSTGRES_URL (bash .ci/run starts one and sets it)")
    with fresh_schema(POSTGRES_URL) as url:
        yield url


@dataclass
class LiveServer:
    url: str
    settings: Settings
    app: Any
    stop: Callable[[], None] = lambda: None  # stops it (as its process ending would); the test's end does it too

    @property
    def broker(self) -> Any:
        return self.app.broker

    @property
    def token(self) -> str | None:
        """Its trainer token (None if it was started without one)."""
        secret = self.settings.trainer_token if self.settings is not None else None
        return secret.get_secret_value() if secret is not None else None


def error_body(body: object) -> dict[str, Any]:
    """The JSON body of an SDK's status error (the SDKs type it `object`: whatever the server answered)."""
    assert isinstance(body, dict), body
    return body


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@dataclass
class Running:
    server: Front
    thread: threading.Thread
    live: LiveServer

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(timeout=15)


def start_server(settings: Settings) -> Running:
    """Run trajproxy on a thread of its own, on a free loopback port."""
    app = create_app(settings)
    return serve_app(app, app.settings)


def new_token() -> str:
    return f"test-trainer-{secrets.token_hex(8)}"


def serve_app(app: Any, settings: Any = None) -> Running:
    """Run an ASGI app on TEST_SERVER on a thread of its own, on a free loopback port (and its Unix socket)."""
    sock = _free_socket()
    port = sock.getsockname()[1]
    sockets = [sock]
    if settings is not None and settings.socket_path:
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(settings.socket_path)
        sockets.append(unix)
    for each in sockets:
        each.listen(LISTEN_BACKLOG)
    limits = Limits.of(settings) if isinstance(settings, Settings) else Limits()
    server = front(TEST_SERVER, app, sockets, log_level="warning", graceful_s=2, limits=limits)
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    running = Running(server, thread, LiveServer(f"http://127.0.0.1:{port}", settings, app))
    running.live.stop = running.stop
    return running


@pytest.fixture
def make_server(database_url: str) -> Iterator[Callable[..., LiveServer]]:
    """Start servers on the test's database with given setting overrides; all stop after the test. Each has a
    trainer token of its own unless the overrides give one or opt out (`no_trainer_token=True`)."""
    running: list[Running] = []

    def make(**overrides: Any) -> LiveServer:
        token = {} if {"trainer_token", "no_trainer_token"} & set(overrides) else {"trainer_token": new_token()}
        settings = Settings(
            _env_file=None,
            database_url=database_url,
            **{"keepalive_s": 0.2, "turn_timeout_s": 30.0, "lease_s": 30.0, "retry_grace_s": 0.3, **token, **overrides},
        )
        running.append(start_server(settings))
        return running[-1].live

    yield make
    for item in running:
        item.stop()


@pytest.fixture
def server(make_server: Callable[..., LiveServer], request: pytest.FixtureRequest) -> LiveServer:
    marker = request.node.get_closest_marker("settings")
    return make_server(**(marker.kwargs if marker else {}))


@pytest.fixture
def trainer(server: LiveServer) -> Iterator[TrainerClient]:
    with TrainerClient(server.url, token=server.token) as client:
        yield client


@pytest.fixture(params=sorted(LANES))
def lane(trainer: TrainerClient, request: pytest.FixtureRequest) -> Iterator[Lane]:
    """How the trainer under test takes turns and answers them: HTTP pulls and replies, replies that pull the next
    batch, or the WebSocket stream. Delivery's rules are the same on each."""
    chosen = LANES[request.param](trainer)
    yield chosen
    chosen.close()


@pytest.fixture
def background() -> Iterator[Callable[..., Future[Any]]]:
    """Run a blocking call (an agent's SDK request) on another thread; returns its future."""
    with ThreadPoolExecutor(max_workers=16) as pool:
        yield pool.submit


# An upstream model, faked.


@dataclass
class FakeModel:
    """An upstream model server (a fake: real models are external and expensive): answers every chat
    request with a canned reply, or fails when the last message says "please fail"."""

    url: str = ""
    seen: list[dict[str, Any]] = field(default_factory=list)

    def options(self) -> dict[str, Any]:
        return {"api_base": f"{self.url}/v1", "api_key": "sk-fake", "max_retries": 0}


@pytest.fixture
def fake_model() -> Iterator[FakeModel]:
    fake = FakeModel()
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Any:
        body = await request.json()
        fake.seen.append(body)
        if body["messages"][-1]["content"] == "please fail":
            return JSONResponse({"error": {"message": "the model is down", "type": "server_error"}}, 500)
        return {
            "id": "chatcmpl-upstream",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"upstream saw {len(body['messages'])} messages"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        }

    running = serve_app(app)
    fake.url = running.live.url
    yield fake
    running.stop()


# A real inference server: vLLM on the CPU with the tiny model, for the served policy.


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM serving a private copy of the tiny model (a test reloads weights into it), started once a session:
    .ci/vllm caches its environment between runs, so the first start costs a minute, not the install."""
    model = copy_model(build_tiny_model(), tmp_path_factory.mktemp("tiny-model"))
    with vllm_server(model) as server:
        yield server


# Docker: sandboxes on a real engine.

SANDBOX_IMAGE = "python:3.11-slim"


def output_of(engine: Any, image: str, command: list[str], **options: Any) -> str:
    """What `command` prints in a new container of `image`, read once it has exited: docker-py's `containers.run`
    follows the log stream as the container starts, and under load the engine can end that stream before a
    short-lived container's output reaches it (an empty result for a command that printed)."""
    container = engine.containers.run(image, command, detach=True, **options)
    try:
        status = container.wait(timeout=300)["StatusCode"]
        out: str = container.logs(stdout=True, stderr=True).decode()
        assert status == 0, f"{command} exited {status}: {out}"
        return out
    finally:
        container.remove(force=True)


@pytest.fixture(scope="session")
def engine() -> Iterator[Any]:
    client = None
    try:
        client = docker.from_env()
        client.ping()
        client.images.get(SANDBOX_IMAGE)
    except docker.errors.DockerException as e:
        if client is not None:
            client.close()
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Docker tests, but the engine is not ready: {e}")
        pytest.skip(f"no Docker engine with {SANDBOX_IMAGE} ({e}); run ../shared/tools/docker-up or bash .ci/run")
    yield client
    client.close()


@pytest.fixture
def socket_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tp")  # short: Unix socket paths are limited to 108 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sandboxes(engine: Any, socket_dir: str) -> Iterator[DockerSandboxes]:
    """Sandboxes labelled for this test alone, so tests (and test runs) sharing an engine never meet."""
    factory = DockerSandboxes(socket_dir, labels={"trajproxy.test": secrets.token_hex(6)})
    yield factory
    leftovers = remove_labelled(engine, mine(factory))
    assert not leftovers, "a test left containers behind"


@pytest.fixture
def proxied(make_server: Callable[..., LiveServer], socket_dir: str) -> LiveServer:
    return make_server(socket_path=f"{socket_dir}/proxy.sock")


@pytest.fixture
def proxied_trainer(proxied: LiveServer) -> Iterator[TrainerClient]:
    """A trainer client of the `proxied` server, closed after the test."""
    with TrainerClient(proxied.url, token=proxied.token) as client:
        yield client


@pytest.fixture
def label(engine: Any) -> Iterator[str]:
    """A Docker label for this test's containers alone (`trajproxy run --label` it); whatever carries it is removed
    after the test, and nothing else is touched."""
    mark = f"trajproxy-test.run={secrets.token_hex(6)}"
    yield mark
    remove_labelled(engine, mark)


def remove_labelled(engine: Any, labels: str | list[str]) -> list[Any]:
    """Remove the containers carrying `labels`; returns those there were. One may go while this runs (a run that
    timed out still cleans up on its threads): gone, or already being removed, is what this wants."""
    there = engine.containers.list(all=True, filters={"label": labels})
    for container in there:
        try:
            container.remove(force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if e.status_code != 409 or "already in progress" not in str(e.explanation):
                raise
    return list(there)


def mine(factory: DockerSandboxes) -> list[str]:
    """A docker label filter for the containers this factory started."""
    return [f"{name}={value}" for name, value in factory.labels.items()]


# The example task, built from the repository's own Dockerfiles.

AGENT_IMAGE = "trajproxy/agent-minimal"
TASK_IMAGE = "trajproxy/example-calc"


@pytest.fixture(scope="session")
def task_image(engine: Any) -> str:
    """The example task's image, built from the repo's own Dockerfiles (the agent's first)."""
    engine.images.build(path=str(ROOT / "agents" / "minimal"), tag=AGENT_IMAGE, rm=True)
    engine.images.build(path=str(EXAMPLE), tag=TASK_IMAGE, rm=True)
    return TASK_IMAGE


@pytest.fixture
def example_task(task_image: str) -> Task:
    [task] = list(read_tasks(EXAMPLE / "tasks.jsonl"))
    assert isinstance(task, Task)
    return task
