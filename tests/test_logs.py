"""No log line holds an episode key or the trainer token: a real `trajproxy serve` (on TEST_SERVER) at debug level, raw
WebSocket handshakes on every kind of route, and the real Codex CLI probing its WebSocket transport on a base URL
that carries the key (`/e/<key>/v1`)."""

from __future__ import annotations

import logging
import socket
import subprocess
from pathlib import Path

import httpx

from proxy.client import TrainerClient
from proxy.servers.redaction import KeyRedactor
from tests.test_agent_clis import answer_until_exit, cli, folders, tool_calls
from tests.test_cli import clean_env, free_port, serving

HANDSHAKE = (
    "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nAuthorization: Bearer {key}\r\n\r\n"
)


def handshake(port: int, path: str, key: str) -> str:
    """Send a WebSocket handshake; the status code of the answer (wsproto sends no reason phrase, granian does)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(HANDSHAKE.format(path=path, key=key).encode())
        status_line = sock.recv(4096).decode("latin-1").split("\r\n", 1)[0]
        assert status_line.startswith("HTTP/1.1 "), status_line
        return status_line.split()[1]


def secrets_in(log: str, *secrets: str) -> list[str]:
    return [line for line in log.splitlines() if any(secret in line for secret in secrets)]


def test_handshakes_are_refused_at_once_with_426_and_no_key_is_logged_from_a_path_or_a_query(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serving(["--port", str(port), "--log-level", "debug"], tmp_path) as served:
        served.wait_healthy(port)
        with TrainerClient(url) as trainer:
            key = trainer.create_episode(task="t").key
        token = Path(clean_env()["TRAJPROXY_TRAINER_TOKEN_FILE"]).read_text().strip()
        paths = [f"/e/{key}/v1/responses", f"/e/{key}/v1/chat/completions", "/v1/messages", "/api/turns/next", "/"]
        for path in paths:
            assert handshake(port, path, key) == "426", path
        for path in (f"/e/{key}/v1/models", f"/e/{key}/v1/no-such-route"):  # plain requests: no access log line
            httpx.get(f"{url}{path}", timeout=5)
        # Google's SDKs may send the key as a query parameter: counted, refused or not found, never logged.
        gemini = f"{url}/v1beta/models/policy"
        body = {"contents": [{"parts": [{"text": "x"}]}]}
        counted = httpx.post(f"{gemini}:countTokens", params={"key": key}, json=body)
        assert counted.status_code == 200, counted.text
        assert httpx.post(f"{gemini}:generateContent", params={"key": key}, content=b"{").status_code == 400
        assert httpx.post(f"{gemini}:embedContent", params={"key": key, "alt": "sse"}, json={}).status_code == 404
        # A name percent-encoded is the same name to the server (%6Bey is key): the log holds none of these either.
        for name in ("%6Bey", "k%65y", "ke%79", "%4B%45%59"):
            assert httpx.post(f"{gemini}:countTokens?alt=json&{name}={key}", json=body).status_code in (200, 401)
            assert handshake(port, f"/v1beta/models/policy:generateContent?{name}={key}", key) == "426"
        assert handshake(port, "/api/episodes", token) == "426"
    log = served.output()
    assert "serving on" in log and "Application shutdown complete" in log, log  # read from start to end: no secret
    assert secrets_in(log, key, token) == []


def test_codex_probing_websockets_falls_back_to_http_at_once_and_no_log_line_holds_its_key(tmp_path: Path) -> None:
    codex = cli("codex")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serving(["--port", str(port), "--log-level", "debug"], tmp_path) as served, TrainerClient(url) as trainer:
        served.wait_healthy(port)
        episode = trainer.create_episode(task="t")
        work, home = folders(tmp_path, "work", "codex-home")
        (home / "config.toml").write_text(
            'model = "policy"\nmodel_provider = "trajproxy"\n\n[model_providers.trajproxy]\nname = "trajproxy"\n'
            f'base_url = "{url}/e/{episode.key}/v1"\nwire_api = "responses"\nsupports_websockets = true\n'
        )
        agent = subprocess.Popen(
            [codex, "exec", "--skip-git-repo-check", "-s", "danger-full-access", "Create hello.txt containing hi"],
            cwd=work, env={**clean_env(), "HOME": str(home), "CODEX_HOME": str(home)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        answer_until_exit(trainer, agent, tool_calls("exec_command", {"cmd": "echo hi > hello.txt"}))
        _, stderr = agent.communicate()
        assert agent.returncode == 0, stderr[-2000:]
        assert (work / "hello.txt").read_text() == "hi\n"
        # One probe, answered 426, and Codex goes on over HTTP: no retries with backoff (a 403 drew seven).
        assert stderr.count("failed to connect to Responses WebSocket") == 1, stderr[-2000:]
        assert len(trainer.trajectory(episode.id).turns) == 2
    token = Path(clean_env()["TRAJPROXY_TRAINER_TOKEN_FILE"]).read_text().strip()
    assert secrets_in(served.output(), episode.key, token) == []


def test_an_access_log_line_a_server_was_told_to_write_would_hold_no_key_from_a_path_or_a_query() -> None:
    """Both servers' access logs are off; were one turned on, its lines (uvicorn's format here) lose their keys."""
    target = "/e/tpk-in-path/v1beta/models/policy:streamGenerateContent?alt=sse&key=tpk-in-query"
    args = ("127.0.0.1:5000", "POST", target, "1.1", 200)
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d', args, None)
    assert KeyRedactor().filter(record)
    assert record.getMessage() == (
        '127.0.0.1:5000 - "POST /e/<key>/v1beta/models/policy:streamGenerateContent?alt=sse&key=<key> HTTP/1.1" 200'
    )


def test_a_key_is_redacted_by_the_name_the_server_reads_however_the_line_spells_it() -> None:
    """What a server parses as `key` (any percent-encoding of the name, `+` for a space in it) is redacted."""
    for spelled in ("key", "%6Bey", "k%65y", "%6b%65%79", "KEY", "%4Bey", "k%65y+", "%20key"):
        target = f"/v1beta/models/policy:generateContent?alt=sse&{spelled}=tpk-secret%2Dpart&n=1"
        args = ("127.0.0.1:5000", "POST", target, "1.1", 200)
        record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d', args, None)
        assert KeyRedactor().filter(record)
        line = record.getMessage()
        assert "tpk-secret" not in line and f"?alt=sse&{spelled}=<key>&n=1 " in line, line
        record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, f'"WebSocket {target}" 426', (), None)
        assert KeyRedactor().filter(record) and "tpk-secret" not in record.getMessage(), record.getMessage()
    header = logging.LogRecord("websockets", logging.DEBUG, __file__, 1, "> %s: %s", ("X-Goog-Api-Key", "tpk-s"), None)
    assert KeyRedactor().filter(header) and header.getMessage() == "> X-Goog-Api-Key: <redacted>"  # Gemini's header
    kept = "/v1beta/models/policy:generateContent?monkey=visible&keys=visible"  # other names stay as they are
    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, kept, (), None)
    assert KeyRedactor().filter(record) and record.getMessage() == kept
