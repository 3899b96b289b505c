"""The real `trajproxy` console script, run as a subprocess: start-up, settings from flags and env, refusals."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from proxy import __version__
from proxy.client import TrainerClient
from testkit.tasks import EXAMPLE
from tests.conftest import TEST_SERVER

# A cold interpreter imports fastapi, sqlalchemy and pydantic: a second or two when idle, but over 20 s on a 2-core
# machine at load 12 (CI). The wait ends as soon as /health answers, so a long deadline costs only a failing test.
START_S = 120
EXIT_S = 30
pytestmark = pytest.mark.timeout(3 * START_S)  # a test starts the script up to three times


def trajproxy_script() -> str:
    beside = Path(sys.executable).parent / "trajproxy"
    found = str(beside) if beside.exists() else shutil.which("trajproxy")
    if found is None:
        pytest.fail("the `trajproxy` console script is not installed (pip install -e .)")
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any TRAJPROXY_* setting but the test run's token file, plus `extra`."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("TRAJPROXY_")}
    kept = {"TRAJPROXY_TRAINER_TOKEN_FILE": os.environ["TRAJPROXY_TRAINER_TOKEN_FILE"], "TRAJPROXY_SERVER": TEST_SERVER}
    return {**env, **kept, **extra}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_cli(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [trajproxy_script(), *args],
        cwd=cwd,
        env=env if env is not None else clean_env(),
        capture_output=True,
        text=True,
        timeout=EXIT_S,
    )


class Served:
    def __init__(self, process: subprocess.Popen[bytes], log: Path) -> None:
        self.process = process
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_healthy(self, port: int, host: str = "127.0.0.1") -> float:
        """Poll GET /health until it answers 200 (`host`: a URL's host part); returns the seconds since the start."""
        started = time.monotonic()
        url = f"http://{host}:{port}/health"
        while time.monotonic() - started < START_S:
            if self.process.poll() is not None:
                pytest.fail(f"trajproxy exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        pytest.fail(f"trajproxy did not answer /health within {START_S} s:\n{self.output()}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=EXIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=EXIT_S)
        return self.process.returncode


@contextmanager
def serving(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> Iterator[Served]:
    log = cwd / f"trajproxy-{time.monotonic_ns()}.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [trajproxy_script(), "serve", *args],
            cwd=cwd,
            env=env if env is not None else clean_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    served = Served(process, log)
    try:
        yield served
    finally:
        served.stop()


def journal_mode(database: Path) -> str:
    with sqlite3.connect(database) as conn:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0])


def test_version(tmp_path: Path) -> None:
    done = run_cli(["--version"], tmp_path)
    assert done.returncode == 0
    assert done.stdout.strip() == f"trajproxy {__version__}"


def test_serve_answers_health_on_a_sqlite_file_in_wal_mode(tmp_path: Path) -> None:
    port = free_port()
    database = tmp_path / "x.db"
    with serving(["--port", str(port), "--database-url", f"sqlite:///{database}"], tmp_path) as served:
        start_s = served.wait_healthy(port)
        print(f"trajproxy serve answered /health {start_s:.2f} s after it was started")
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
        assert health["status"] == "ok"
        assert database.is_file()
        assert journal_mode(database) == "wal"
        # SIGTERM shuts it down cleanly (uvicorn re-raises the signal once its shutdown is complete).
        assert served.stop() in (0, -signal.SIGTERM), served.output()
        assert "Application shutdown complete" in served.output()


def test_the_listening_socket_queues_a_burst_of_connections(tmp_path: Path) -> None:
    """Thousands of agents connect at once when a run starts: the accept queue is as long as the kernel allows
    (up to 16,384), not uvicorn's default of 2,048."""
    port = free_port()
    with serving(["--port", str(port), "--database-url", f"sqlite:///{tmp_path}/x.db"], tmp_path) as served:
        served.wait_healthy(port)
        listening = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True)
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    backlog = int(listening.stdout.split()[2])  # for a listening socket, Send-Q is its backlog
    assert backlog == min(16384, somaxconn), listening.stdout


def test_default_database_is_trajproxy_db_in_the_working_directory(tmp_path: Path) -> None:
    port = free_port()
    with serving(["--port", str(port)], tmp_path) as served:
        served.wait_healthy(port)
        assert (tmp_path / "trajproxy.db").is_file()
        assert journal_mode(tmp_path / "trajproxy.db") == "wal"


@pytest.mark.parametrize("how", ["flag", "env"])
def test_refuses_a_public_address_opted_out_of_the_trainer_token(tmp_path: Path, how: str) -> None:
    port = str(free_port())
    if how == "flag":
        done = run_cli(["serve", "--host", "0.0.0.0", "--port", port, "--no-trainer-token"], tmp_path)
    else:
        env = clean_env(TRAJPROXY_HOST="0.0.0.0", TRAJPROXY_NO_TRAINER_TOKEN="true")
        done = run_cli(["serve", "--port", port], tmp_path, env)
    assert done.returncode != 0
    assert "TRAJPROXY_TRAINER_TOKEN" in done.stderr
    assert "0.0.0.0" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "trajproxy.db").exists()


def test_with_no_token_given_one_is_made_once_kept_owner_only_and_found_by_the_client(tmp_path: Path) -> None:
    token_file = tmp_path / "config" / "trajproxy" / "trainer-token"
    env = clean_env(TRAJPROXY_TRAINER_TOKEN_FILE=str(token_file))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serving(["--port", str(port)], tmp_path, env) as served:
        served.wait_healthy(port)
        token = token_file.read_text().strip()
        assert (token_file.stat().st_mode & 0o777, token_file.parent.stat().st_mode & 0o777) == (0o600, 0o700)
        assert httpx.get(f"{url}/api/episodes", timeout=5).status_code == 401
        assert str(token_file) in served.output() and token not in served.output()  # where it is, never what
    with serving(["--port", str(port)], tmp_path, env) as served:  # a restart keeps the same token
        served.wait_healthy(port)
        assert token_file.read_text().strip() == token
        os.environ["TRAJPROXY_TRAINER_TOKEN_FILE"], kept = str(token_file), os.environ["TRAJPROXY_TRAINER_TOKEN_FILE"]
        try:
            with TrainerClient(url) as trainer:  # no token passed: it reads the file
                assert trainer.create_episode(task="found").task == "found"
        finally:
            os.environ["TRAJPROXY_TRAINER_TOKEN_FILE"] = kept
    token_file.chmod(0o644)  # readable by others: refused, not served with
    done = run_cli(["serve", "--port", str(port)], tmp_path, env)
    assert done.returncode != 0 and f"chmod 600 {token_file}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_no_trainer_token_opens_the_api_on_loopback(tmp_path: Path) -> None:
    token_file = tmp_path / "trainer-token"
    port = free_port()
    env = clean_env(TRAJPROXY_TRAINER_TOKEN_FILE=str(token_file))
    with serving(["--port", str(port), "--no-trainer-token"], tmp_path, env) as served:
        served.wait_healthy(port)
        assert httpx.get(f"http://127.0.0.1:{port}/api/episodes", timeout=5).status_code == 200
    assert not token_file.exists()


def test_a_public_address_with_a_trainer_token_starts_and_guards_the_trainer_api(tmp_path: Path) -> None:
    port = free_port()
    args = ["--host", "0.0.0.0", "--port", str(port), "--trainer-token", "tok-flag"]
    with serving(args, tmp_path) as served:
        served.wait_healthy(port)
        api = f"http://127.0.0.1:{port}/api/episodes"
        assert httpx.get(api, timeout=5).status_code == 401
        assert httpx.get(api, headers={"Authorization": "Bearer tok-flag"}, timeout=5).status_code == 200


def test_trajproxy_environment_variables_are_honoured(tmp_path: Path) -> None:
    port = free_port()
    env = clean_env(
        TRAJPROXY_PORT=str(port),
        TRAJPROXY_HOST="0.0.0.0",
        TRAJPROXY_TRAINER_TOKEN="tok-env",
        TRAJPROXY_DATABASE_URL=f"sqlite:///{tmp_path}/env.db",
        TRAJPROXY_PUBLIC_URL="http://proxy.example:9000",
    )
    with serving([], tmp_path, env) as served:
        served.wait_healthy(port)
        assert (tmp_path / "env.db").is_file()
        assert not (tmp_path / "trajproxy.db").exists()
        api = f"http://127.0.0.1:{port}/api/episodes"
        assert httpx.get(api, timeout=5).status_code == 401
        created = httpx.post(api, json={"task": "t"}, headers={"Authorization": "Bearer tok-env"}, timeout=5)
        assert created.status_code == 201, created.text
        assert created.json()["env"]["OPENAI_BASE_URL"] == "http://proxy.example:9000/v1"


def test_flags_override_environment_variables(tmp_path: Path) -> None:
    env_port, flag_port = free_port(), free_port()
    env = clean_env(
        TRAJPROXY_PORT=str(env_port),
        TRAJPROXY_TRAINER_TOKEN="tok-env",
        TRAJPROXY_DATABASE_URL=f"sqlite:///{tmp_path}/env.db",
        TRAJPROXY_TURN_TIMEOUT_S="-1",  # invalid on its own; the flag below must win
    )
    args = [
        "--port",
        str(flag_port),
        "--trainer-token",
        "tok-flag",
        "--database-url",
        f"sqlite:///{tmp_path}/flag.db",
        "--turn-timeout-s",
        "5",
    ]
    with serving(args, tmp_path, env) as served:
        served.wait_healthy(flag_port)
        assert (tmp_path / "flag.db").is_file()
        assert not (tmp_path / "env.db").exists()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{env_port}/health", timeout=2)
        api = f"http://127.0.0.1:{flag_port}/api/episodes"
        assert httpx.get(api, headers={"Authorization": "Bearer tok-env"}, timeout=5).status_code == 401
        assert httpx.get(api, headers={"Authorization": "Bearer tok-flag"}, timeout=5).status_code == 200


@pytest.mark.parametrize(
    ("args", "env", "names"),
    [
        (["--turn-timeout-s", "-1"], {}, "turn_timeout_s"),
        (["--port", "70000"], {}, "port"),
        ([], {"TRAJPROXY_LEASE_S": "0"}, "lease_s"),
        ([], {"TRAJPROXY_PORT": "eighty"}, "port"),
        (["--max-body-bytes", "0"], {}, "max_body_bytes"),
        (["--log-level", "loud"], {}, "log_level"),
    ],
    ids=["turn-timeout", "port-range", "lease-env", "port-env", "max-body", "log-level"],
)
def test_invalid_settings_exit_non_zero_with_a_readable_message(
    tmp_path: Path, args: list[str], env: dict[str, str], names: str
) -> None:
    defaults = ["--database-url", f"sqlite:///{tmp_path}/x.db"]
    if "--port" not in args and "TRAJPROXY_PORT" not in env:
        defaults += ["--port", str(free_port())]
    done = run_cli(["serve", *defaults, *args], tmp_path, clean_env(**env))
    assert done.returncode != 0
    assert names in done.stderr
    assert "invalid settings" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_flag_of_the_wrong_type_is_a_usage_error(tmp_path: Path) -> None:
    done = run_cli(["serve", "--port", "abc"], tmp_path)
    assert done.returncode == 2
    assert "--port" in done.stderr
    assert "usage: trajproxy serve" in done.stderr


@pytest.mark.parametrize("scheme", ["unknown-driver", "unreachable-server"])
def test_a_database_it_cannot_open_stops_start_up_naming_the_database(tmp_path: Path, scheme: str) -> None:
    secret = "s3cr3t-password"
    if scheme == "unknown-driver":
        url = f"nosuchdb://user:{secret}@localhost/db"
    else:
        url = f"postgresql://user:{secret}@127.0.0.1:{free_port()}/db"
    done = run_cli(["serve", "--port", str(free_port()), "--database-url", url], tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "cannot open the database" in output
    assert secret not in output


BAD_DATABASES = {
    "postgres-unreachable": "postgres://user:{secret}@127.0.0.1:{port}/db",
    "not-a-url": "notaurl",
    "sqlite-in-a-missing-folder": "sqlite:///{folder}/missing/x.db",
}


@pytest.mark.parametrize("command", ["serve", "export", "run"])
@pytest.mark.parametrize("case", BAD_DATABASES)
def test_a_bad_database_url_is_one_line_and_nothing_is_said_served(tmp_path: Path, command: str, case: str) -> None:
    secret = "s3cr3t-password"
    url = BAD_DATABASES[case].format(secret=secret, port=free_port(), folder=tmp_path)
    if command == "serve":
        args = ["serve", "--port", str(free_port()), "--database-url", url]
    elif command == "export":
        args = ["export", str(tmp_path / "out.jsonl"), "--database-url", url]
    else:
        args = ["run", str(EXAMPLE / "tasks.jsonl"), "--agent-cmd", "true", "--port", str(free_port())]
        args += ["--database-url", url]
    done = run_cli(args, tmp_path)
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode != 0, said
    assert len(said) == 1, said
    assert "database" in said[0] and "Traceback" not in said[0] and secret not in said[0]
    assert "serving" not in said[0]


LITELLM_PROBE = """
import socket, sys, threading, time, urllib.request

import proxy.cli.main
import uvicorn
from proxy.app import create_app
from proxy.settings import Settings
from proxy.adapters.tiktoken_counter import TiktokenCounter

app = create_app(Settings(database_url=sys.argv[1]))
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
thread.start()
deadline = time.monotonic() + 20
while not server.started and thread.is_alive() and time.monotonic() < deadline:
    time.sleep(0.01)
port = sock.getsockname()[1]
assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200
assert "tiktoken" not in sys.modules  # an encoding costs ~80 MiB: loaded when a reply first lacks usage
counter = TiktokenCounter()
assert not counter.ready("policy")
assert counter.count_completion({"role": "assistant", "content": "hello there"}) > 0  # counting too
assert counter.count_prompt({"model": "policy", "messages": []}) > 0 and counter.ready("policy")
server.should_exit = True
thread.join(10)
print(sorted(name for name in sys.modules if name.split(".")[0] in ("litellm", "psycopg", "aiohttp", "rich")))
"""  # (psycopg: Postgres's; aiohttp: a served policy's; rich: an upgrade's progress)


def test_no_litellm_token_encoding_psycopg_or_aiohttp_is_loaded_when_a_server_on_sqlite_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", LITELLM_PROBE, f"sqlite:///{tmp_path}/probe.db"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=EXIT_S + 20,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("front", ["granian", "uvicorn"])
def test_the_server_flag_chooses_the_http_server_in_front(tmp_path: Path, front: str) -> None:
    """`--server` wins over TRAJPROXY_SERVER; either serves, says which it is, and stops on SIGTERM."""
    port = free_port()
    other = "uvicorn" if front == "granian" else "granian"
    args = ["--port", str(port), "--database-url", f"sqlite:///{tmp_path}/x.db", "--server", front]
    with serving(args, tmp_path, clean_env(TRAJPROXY_SERVER=other)) as served:
        served.wait_healthy(port)
        assert served.stop() in (0, -signal.SIGTERM), served.output()
    assert f"({front})" in served.output()
    assert "Application shutdown complete" in served.output()


def test_an_unknown_server_is_refused_in_one_line(tmp_path: Path) -> None:
    done = run_cli(["serve", "--port", str(free_port()), "--server", "nginx"], tmp_path)
    assert done.returncode == 2
    assert "--server: invalid choice: 'nginx'" in done.stderr


def test_connections_to_the_served_socket_send_without_delay(tmp_path: Path) -> None:
    """Every connection `trajproxy serve` accepts has Nagle's algorithm off, whichever server is in front: granian
    leaves its WebSocket connections as accepted, and a trainer's stream then waited out delayed ACKs (44 ms a turn)."""
    from proxy.servers.sockets import listen
    from proxy.settings import Settings

    [listening] = listen(Settings(host="127.0.0.1", port=0, database_url=f"sqlite:///{tmp_path}/x.db"))
    with listening, socket.create_connection(listening.getsockname()[:2]):
        accepted, _ = listening.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
