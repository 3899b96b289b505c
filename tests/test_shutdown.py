"""A stopping trajproxy (SIGTERM, Ctrl-C, the end of `trajproxy run`) ends the trainer's open long polls as its
shutdown begins, on both servers: a pull is answered with the turns it has (none), a dm_env step with 503, the
stream is closed with 1012 (service restart); a parked call the grace cannot save is answered 503. No traceback
reaches the log."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from proxy.client import TrainerClient
from tests.test_cli import Served, clean_env, free_port, serving
from tests.test_faults import wait_until

pytestmark = pytest.mark.timeout(120)

POLL_S = 300  # longer than any grace: a poll answered before it ran out was ended by the shutdown


def health(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/health", timeout=5).json())


def token() -> str:
    return Path(clean_env()["TRAJPROXY_TRAINER_TOKEN_FILE"]).read_text().strip()


def stopped_cleanly(served: Served) -> str:
    code = served.stop()
    log = served.output()
    assert code in (0, -15), log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    return log


def stream_until_closed(url: str, auth: dict[str, str]) -> tuple[Callable[[], tuple[int | None, str | None]], Any]:
    """Open the trainer's stream and read it on a thread until the server closes it: (close code, reason)."""
    ws = connect(url.replace("http", "ws", 1) + "/api/turns/stream", additional_headers=auth, open_timeout=10)
    closed: dict[str, Any] = {}

    def read() -> None:
        try:
            for _ in ws:
                pass
        except Exception as e:  # how it ended is read from the socket's close code
            closed["error"] = e

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def result() -> tuple[int | None, str | None]:
        reader.join(timeout=60)
        assert not reader.is_alive(), "the stream was never closed"
        return ws.close_code, ws.close_reason

    return result, ws


def test_a_stopping_server_ends_open_long_polls_at_once(tmp_path: Path, background: Callable[..., Future[Any]]) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serving(["--port", str(port), "--database-url", f"sqlite:///{tmp_path}/t.db"], tmp_path) as served:
        served.wait_healthy(port)
        auth = {"authorization": f"Bearer {token()}"}
        with TrainerClient(url, token=token()) as trainer:
            episode = trainer.create_episode(task="t")
        with httpx.Client(base_url=url, headers=auth, timeout=60) as client:
            pulled = background(client.get, "/api/turns/next", params={"wait": POLL_S})
            gone = {"replies": [{"turn_id": "tn_gone", "message": {"role": "assistant", "content": "x"}}]}
            replied = background(client.post, "/api/turns/replies", params={"pull": 4, "wait": POLL_S}, json=gone)
            reset = background(client.post, f"/api/episodes/{episode.id}/reset", params={"wait": POLL_S})
            stream_closed, ws = stream_until_closed(url, auth)
            wait_until(lambda: health(url)["waiting_pollers"] == 4)  # each long poll is waiting, the stream's too

            log = stopped_cleanly(served)

            assert pulled.result().status_code == 200 and pulled.result().json() == {"turns": []}, log
            assert replied.result().status_code == 200, replied.result().text
            assert replied.result().json()["turns"] == [] and len(replied.result().json()["results"]) == 1
            assert reset.result().status_code == 503, reset.result().text
            assert "shutting down" in reset.result().json()["error"]["message"]
            code, reason = stream_closed()
            ws.close()
            assert code == 1012, (code, reason)  # service restart: the app says so, or uvicorn as it stops


def test_a_call_still_parked_after_the_grace_is_answered_503_without_a_traceback(
    tmp_path: Path, background: Callable[..., Future[Any]]
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serving(["--port", str(port), "--database-url", f"sqlite:///{tmp_path}/t.db"], tmp_path) as served:
        served.wait_healthy(port)
        with TrainerClient(url, token=token()) as trainer:
            episode = trainer.create_episode(task="t")
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        auth = {"authorization": f"Bearer {episode.key}"}
        with httpx.Client(base_url=url, headers=auth, timeout=60) as client:
            parked = background(client.post, "/v1/chat/completions", json=body)
            wait_until(lambda: health(url)["open_turns"] == 1)

            stopped_cleanly(served)

            answer = parked.result()
            assert answer.status_code == 503, answer.text
            assert "shutting down" in answer.json()["error"]["message"]
            assert answer.headers["retry-after"] == "1"
