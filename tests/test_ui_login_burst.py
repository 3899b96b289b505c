"""Wrong guesses at the page's login sent all at once from one address: a few are checked, the rest answered 429
with a Retry-After, and the token itself waits too. Each guess on a connection of its own, its headers sent on all
connections before any body, so that every one is in the server before the first is checked."""

from __future__ import annotations

import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from proxy.http.ui.throttle import FREE_FAILURES

BURST = 40


def status_of(connection: socket.socket) -> tuple[int, str]:
    """The status and the headers' text of the answer on a connection (it closes after one answer)."""
    answer = b""
    while b"\r\n\r\n" not in answer and (chunk := connection.recv(65536)):
        answer += chunk
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    return int(head.split(" ", 2)[1]), head.lower()


def test_a_burst_of_wrong_logins_from_one_address_is_checked_only_a_few_times(server: Any) -> None:
    where = urlsplit(server.url)
    connections = [socket.create_connection((where.hostname, where.port), timeout=30) for _ in range(BURST)]
    try:
        for number, connection in enumerate(connections):
            body = f"token=guess-{number:04d}".encode()
            head = f"POST /ui/login HTTP/1.1\r\nhost: {where.netloc}\r\nconnection: close\r\n"
            head += f"content-type: application/x-www-form-urlencoded\r\ncontent-length: {len(body)}\r\n\r\n"
            connection.sendall(head.encode())
        time.sleep(0.5)  # the server reads every guess's headers and waits for its body (it passes without, too)
        for number, connection in enumerate(connections):
            connection.sendall(f"token=guess-{number:04d}".encode())
        answers = [status_of(connection) for connection in connections]
    finally:
        for connection in connections:
            connection.close()
    checked = [head for status, head in answers if status == 401]
    held = [head for status, head in answers if status == 429]
    assert len(checked) + len(held) == BURST
    assert 1 <= len(checked) <= FREE_FAILURES + 1, f"{len(checked)} guesses checked before the first wait"
    assert all("\r\nretry-after: " in head for head in held)
    token = httpx.post(f"{server.url}/ui/login", data={"token": server.token})
    assert token.status_code == 429 and "set-cookie" not in token.headers
