"""Anthropic's count_tokens, which needs only an episode key: its work is bounded per episode, in concurrency and in
body size, and the server goes on answering while counts run."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from proxy.client import TrainerClient
from proxy.http.counting import COUNTS_PER_EPISODE, MAX_COUNT_BYTES

PATH = "/v1/messages/count_tokens"


def body_of(text: str) -> bytes:
    return orjson.dumps({"model": "claude", "messages": [{"role": "user", "content": text}]})


@contextmanager
def half_sent(url: str, key: str, body: bytes) -> Iterator[socket.socket]:
    """A count whose body is half sent: it holds its place until the rest follows (`sock.sendall`)."""
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        head = f"POST {PATH} HTTP/1.1\r\nhost: x\r\nx-api-key: {key}\r\ncontent-type: application/json\r\n"
        sock.sendall(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 2])
        yield sock


def test_counts_past_the_episodes_share_are_refused_while_others_count(server: Any, trainer: TrainerClient) -> None:
    episode, other = trainer.create_episode(), trainer.create_episode()
    body = body_of("hello " * 1000)
    with httpx.Client(base_url=server.url, timeout=10) as http:
        with ExitStack() as stack:
            held = [stack.enter_context(half_sent(server.url, episode.key, body)) for _ in range(COUNTS_PER_EPISODE)]
            assert http.get("/health").json()["status"] == "ok"  # nothing waits on the counts held
            refused = http.post(PATH, content=body, headers={"x-api-key": episode.key})
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert "count_tokens" in refused.json()["error"]["message"]
            counted = http.post(PATH, content=body, headers={"x-api-key": other.key})  # another episode's share
            assert counted.status_code == 200 and counted.json()["input_tokens"] > 1000
            for sock in held:
                sock.sendall(body[len(body) // 2 :])
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        again = http.post(PATH, content=body, headers={"x-api-key": episode.key})  # the places were given back
        assert again.status_code == 200


def test_a_count_over_its_size_limit_is_refused_before_it_is_read(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    big = body_of("x" * MAX_COUNT_BYTES)
    refused = httpx.post(f"{server.url}{PATH}", content=big, headers={"x-api-key": episode.key}, timeout=30)
    assert refused.status_code == 413 and str(MAX_COUNT_BYTES) in refused.json()["error"]["message"]
