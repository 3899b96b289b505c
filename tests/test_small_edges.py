"""Small sharp edges of the review (issue 49, item 16): bodies that gave 500 are a one-line 400, a reset of an
episode that does not exist is a 404 at once rather than after its wait, the token server serves only the keys
it gave out, and no 404 or log line shows a key however the path or query spells it."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from integrations.token_server import Generated, token_server
from proxy.client import TrainerClient
from proxy.servers.redaction import KeyRedactor
from testkit.vllm_server import build_tiny_model
from tests.test_bad_bodies import assert_one_line_4xx

GEMINI = "/v1beta/models/m:generateContent"
HI = {"role": "user", "parts": [{"text": "hi"}]}
ON_SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the edges, not the storage


@ON_SQLITE
@pytest.mark.parametrize(
    "body",
    [
        {"contents": [HI], "tools": [{"functionDeclarations": 5}]},
        {"contents": [HI], "tools": [{"functionDeclarations": True}]},
        {"contents": [HI], "tools": [{"function_declarations": 2.5}]},
        {"contents": [{"role": "user", "parts": [{"type": "text"}]}]},
        {"contents": [{"role": "user", "parts": [{"type": "text", "text": 7}]}]},
    ],
)
def test_gemini_bodies_that_gave_500_are_a_one_line_400(server: Any, trainer: TrainerClient, body: Any) -> None:
    episode = trainer.create_episode()
    answer = httpx.post(f"{server.url}/e/{episode.key}{GEMINI}", json=body, timeout=10)
    assert answer.status_code == 400, answer.text[:300]
    assert_one_line_4xx(answer, body)


@ON_SQLITE
@pytest.mark.timeout(30)
def test_a_reset_of_an_unknown_episode_is_a_404_at_once(server: Any) -> None:
    headers = {"authorization": f"Bearer {server.token}"}
    answer = httpx.post(f"{server.url}/api/episodes/ep_nothere/reset?wait=600", headers=headers, timeout=10)
    assert answer.status_code == 404 and "ep_nothere" in answer.json()["error"]["message"]


def test_the_token_server_answers_only_under_the_keys_it_gave_and_refuses_a_body_not_json() -> None:
    calls: list[str] = []

    async def generate(key: str, prompt: list[int], sampling: dict[str, Any]) -> Generated:
        calls.append(key)
        return Generated([5, 6], None)

    async def asked() -> list[tuple[int, str]]:
        async with token_server(generate, str(build_tiny_model())) as server:
            given = server.api_base("rollout-1")
            other = given.replace("rollout-1", "rollout-2")
            async with httpx.AsyncClient(timeout=30) as http:
                answers = [
                    await http.post(f"{other}/completions", json={"prompt": [1, 2]}),
                    await http.get(f"{other}/models"),
                    await http.post(f"{given}/completions", content=b"not json"),
                    await http.post(f"{given}/completions", json=[1, 2]),
                    await http.post(f"{given}/completions", json={"prompt": [1, 2]}),
                ]
        return [(answer.status_code, answer.json().get("error", {}).get("message", "")) for answer in answers]

    refused_post, refused_models, not_json, not_object, served = asyncio.run(asked())
    assert refused_post == refused_models == (404, "no rollout under this key")
    assert not_json == (400, "the body is not JSON") and not_object[0] == 400
    assert served == (200, "") and calls == ["rollout-1"]


@ON_SQLITE
def test_a_404_never_echoes_a_key_wherever_e_falls_in_the_path(server: Any, trainer: TrainerClient) -> None:
    key = trainer.create_episode().key
    with httpx.Client(timeout=10) as http:
        for path in (f"//e/{key}/v1/chat/completions", f"/x/e/{key}/v1/models", f"/e/{key}/nothing", f"/{key}/v1"):
            answer = http.post(server.url + path, json={})
            assert 400 <= answer.status_code < 500 and key not in answer.text, (path, answer.text)


def test_a_key_under_a_name_the_server_does_not_read_is_kept_out_of_log_lines() -> None:
    """uvicorn's WebSocket handshake line names the path with its query; `ke%2579` reads as `ke%79`, no name the
    server takes a key from, yet the agent sent its key there."""
    for query in ("ke%2579=sk-secret", "%256B%2565y=sk-secret", "a=1&KE%2579=sk-secret"):
        record = logging.LogRecord("uvicorn.error", logging.INFO, "", 0, '%s - "WebSocket %s" 403', None, None)
        record.args = ("127.0.0.1:5", f"/api/turns/stream?{query}")
        assert KeyRedactor().filter(record)
        assert "sk-secret" not in record.getMessage() and "=<key>" in record.getMessage()


@ON_SQLITE
@pytest.mark.settings(no_trainer_token=True)
def test_an_open_trainer_api_refuses_two_host_headers_whichever_comes_first(server: Any) -> None:
    where = urlsplit(server.url)
    tries = [
        (["evil.example", where.netloc], 400),
        ([where.netloc, "evil.example"], 400),
        ([where.netloc, where.netloc], 400),
        ([where.netloc], 200),
    ]
    for path in ("/api/episodes", "/ui/"):
        for hosts, status in tries:
            with socket.create_connection((where.hostname, where.port), timeout=10) as connection:
                lines = [f"GET {path} HTTP/1.1", *(f"host: {host}" for host in hosts), "connection: close"]
                connection.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
                answer = b""
                while chunk := connection.recv(65536):
                    answer += chunk
            assert answer.split(b" ", 2)[1] == str(status).encode(), (path, hosts, answer[:300])
            if status == 400:
                assert b"names one Host" in answer, answer[-300:]
