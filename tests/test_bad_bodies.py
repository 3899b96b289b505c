"""Any body that is not what a route takes is a 4xx with a one-line message, on every route of both HTTP servers
(conftest's ON_BOTH_SERVERS): bytes that are not UTF-8, wherever they fall, never reach a traceback."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import httpx
import orjson
import pytest
from websockets.sync.client import connect

from proxy.client import TrainerClient
from tests.test_security import AGENT_ROUTES, ask, parked, snapshot, trainer_routes

# Bytes no UTF-8 decoder takes: a stray byte, a sequence cut short, an overlong "/", a surrogate's encoding
NOT_UTF8 = [b"\xff", b"\xc3", b"\xc0\xaf", b"\xed\xa0\x80"]


def spoiled(body: Any) -> list[bytes]:
    """The body with bytes that are not UTF-8 in a string value, in a name, and in place of the whole."""
    raw = orjson.dumps(body if body else {"x": "y"})
    quoted = raw.index(b'"', raw.index(b":") + 1) if b':"' in raw else None
    bodies = list(NOT_UTF8)
    for bad in NOT_UTF8:
        bodies.append(raw[:2] + bad + raw[2:])  # in the first name
        if quoted is not None:
            bodies.append(raw[: quoted + 1] + bad + raw[quoted + 1 :])  # in the first string value
        bodies.append(raw[:-1] + b',"' + bad + b'":"' + bad + b'"}')  # a member of its own
    return bodies


def assert_one_line_4xx(response: httpx.Response, where: Any) -> None:
    assert 400 <= response.status_code < 500, (where, response.status_code, response.text[:300])
    message = response.json()["error"]["message"]
    assert isinstance(message, str) and message and "\n" not in message, (where, message)


@pytest.mark.settings(no_trainer_token=True, turn_timeout_s=600)  # the bodies, not the door; the call outlasts them
def test_a_body_that_is_not_utf8_is_a_one_line_4xx_on_every_route(
    server: Any,
    trainer: TrainerClient,
    background: Callable[..., Future[Any]],
    capfd: pytest.CaptureFixture[str],
) -> None:
    base = server.url
    episode = trainer.create_episode()
    answer = background(ask, f"{base}/v1", episode.key)
    [turn] = parked(trainer, episode.id)
    before = snapshot(base, episode.id)
    http = httpx.Client(base_url=base, headers={"content-type": "application/json"}, timeout=10)
    with http:
        for method, path, body in trainer_routes(episode.id, turn.id):
            if method == "POST" and "/reset" not in path:  # reset takes no body: it reads none
                for raw in spoiled(body):
                    assert_one_line_4xx(http.post(path, content=raw), (path, raw))
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for path in [*AGENT_ROUTES, "/v1beta/models/m:generateContent", "/v1beta/models/m:countTokens"]:
            for raw in spoiled(chat):
                response = http.post(f"/e/{episode.key}{path}", content=raw)
                assert 400 <= response.status_code < 500, (path, raw, response.status_code, response.text[:300])
    assert snapshot(base, episode.id) == before
    assert [e.id for e in trainer.episodes().episodes] == [episode.id]
    with connect(f"{base.replace('http', 'ws')}/api/turns/stream?max=1", proxy=None) as socket:
        assert orjson.loads(socket.recv(timeout=10))["type"] == "turns"
        for raw in spoiled({"id": 1, "replies": [{"turn_id": turn.id, "message": {"content": "x"}}]}):
            socket.send(raw)  # a binary frame: a text frame must be UTF-8 by the protocol itself
            said = orjson.loads(socket.recv(timeout=10))
            assert said["type"] == "error" and 400 <= said["status"] < 500, (raw, said)
    trainer.reply(turn.id, "still answerable")
    assert answer.result(timeout=10) == "still answerable"
    assert "Traceback" not in capfd.readouterr().err
