"""A request whose body stops arriving is answered 408 and its connection closed, on every route and on both
servers trajproxy runs on: a stalled client holds no socket for longer than the body read timeout."""

from __future__ import annotations

import socket
import time
from typing import Any
from urllib.parse import urlsplit

import pytest

from proxy.client import TrainerClient

ROUTES = ["/v1/chat/completions", "/v1/messages/count_tokens", "/api/episodes", "/ui/login"]


def stalled(url: str, path: str, headers: str = "") -> bytes:
    """Send the headers and part of the body, then nothing: what comes back before the server closes."""
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=20) as sock:
        head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n"
        sock.sendall(f"{head}{headers}\r\n".encode() + b'{"messages": [')
        answer = b""
        while chunk := sock.recv(65536):  # until the server closes: a connection it kept would time this out
            answer += chunk
        return answer


@pytest.mark.settings(body_read_timeout_s=0.5)
@pytest.mark.parametrize("path", ROUTES)
def test_a_body_that_stops_arriving_is_answered_408_and_closed(server: Any, trainer: TrainerClient, path: str) -> None:
    credentials = ""
    if path.startswith("/v1"):
        credentials = f"authorization: Bearer {trainer.create_episode().key}\r\n"
    elif path.startswith("/api"):
        credentials = f"authorization: Bearer {server.token}\r\n"
    answer = stalled(server.url, path, credentials)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"stopped arriving" in answer


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_client_that_leaves_before_its_body_is_whole_makes_no_turn(server: Any, trainer: TrainerClient) -> None:
    """What arrived may parse (here, a whole call, 30 bytes short of what its Content-Length says): a call its client
    hung up on before sending it whole is not the agent's call, and nothing is parked or recorded of it."""
    episode = trainer.create_episode()
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    address = urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=20) as sock:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {episode.key}\r\ncontent-length: {len(body) + 30}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        time.sleep(0.3)  # the server has read what came
    # the connection is closed: a call made now on a new one is the episode's first turn
    assert trainer.next_turns(episode=episode.id, wait_s=1) == []
    assert trainer.trajectory(episode.id).turns == []
