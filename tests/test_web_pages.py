"""A web page in the trainer's browser cannot drive a trainer API opened with `--no-trainer-token`: a body a page
may send without asking first (`text/plain`, or no type) is refused, as is any request another origin's page sent or
that names a host other than a loopback one (DNS rebinding); and the URLs handed to agents never come from the Host
header."""

from __future__ import annotations

import socket
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect
from websockets.typing import Origin

from proxy.client import TrainerClient
from tests.test_security import ask, parked, snapshot, trainer_routes

REBOUND = "rebound.example"  # a name whose DNS an attacker points at 127.0.0.1 once the page has loaded


def body_of(value: Any) -> bytes:
    return orjson.dumps(value) if value is not None else b""


@pytest.mark.settings(no_trainer_token=True, turn_timeout_s=600)  # the parked call outlasts every try
def test_an_open_trainer_api_answers_no_web_page(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    base, port = server.url, urlsplit(server.url).port
    episode = trainer.create_episode()
    answer = background(ask, f"{base}/v1", episode.key)
    [turn] = parked(trainer, episode.id)
    before = snapshot(base, episode.id)
    json_type = {"content-type": "application/json"}
    untyped = [  # what a page's fetch or form sends with no CORS preflight: refused 415 on a POST
        {"content-type": "text/plain"},
        {"content-type": "application/x-www-form-urlencoded"},
        {},  # a Blob with no type: no Content-Type at all
    ]
    foreign = [  # another origin's page, or a page on a name pointed at this machine (DNS rebinding): 403
        {"origin": "https://evil.example"},
        {"origin": f"http://localhost:{port + 1}"},  # the same site, another origin
        {"origin": "null"},  # a sandboxed frame, a file:// page
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site"},
        {"host": f"{REBOUND}:{port}", "origin": f"http://{REBOUND}:{port}"},
        {"host": f"{REBOUND}:{port}"},
        # a browser older than Fetch Metadata: its cross-site GET (an <img>, a link) names no page at all
        {"user-agent": "Mozilla/5.0 (Macintosh; Intel Mac OS X 10_15_7) AppleWebKit/605.1.15 Version/15.6 Safari"},
    ]
    with httpx.Client(base_url=base, timeout=10) as http:
        for method, path, body in trainer_routes(episode.id, turn.id):
            tries = [(headers, 415) for headers in untyped] if method == "POST" else []
            tries += [({**json_type, **headers}, 403) for headers in foreign]
            for headers, status in tries:
                response = http.request(method, path, content=body_of(body), headers=headers)
                assert response.status_code == status, (method, path, headers, response.status_code, response.text)
                message = response.json()["error"]["message"]
                assert "\n" not in message and len(message) > 20, message
    for path in ("/ui/", f"/ui/episodes/{episode.id}", "/ui/queue"):  # the page, as open as /api, reads nothing
        assert httpx.get(base + path, headers={"host": f"{REBOUND}:{port}"}).status_code == 403, path
    forged_by_hand = {"origin": f"http://{REBOUND}:{port}", "host": f"{REBOUND}:{port}"}
    by_hand = httpx.post(base + f"/ui/episodes/{episode.id}/rewards", data={"value": "1"}, headers=forged_by_hand)
    assert by_hand.status_code == 403
    stream = f"ws://127.0.0.1:{port}/api/turns/stream?max=1"
    for url, origin in ((stream, Origin("https://evil.example")), (stream.replace("127.0.0.1", REBOUND), None)):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)  # the rebound name, resolved to here
        with pytest.raises(InvalidStatus) as refused:
            connect(url, sock=sock, origin=origin, proxy=None, open_timeout=10).close()
        assert refused.value.response.status_code == 403, url
    assert snapshot(base, episode.id) == before
    assert [e.id for e in trainer.episodes().episodes] == [episode.id]
    assert not answer.done()

    # What the trainer itself sends still works: its client, a program with neither header (curl), a same-origin
    # page, and a browser's own address bar.
    assert httpx.get(f"{base}/api/turns/{turn.id}", headers={"user-agent": "curl/8.5.0"}).status_code == 200
    for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
        page = {"host": host, "origin": f"http://{host}", "sec-fetch-site": "same-origin"}
        assert httpx.get(f"{base}/api/turns/{turn.id}", headers=page).status_code == 200
        assert httpx.get(f"{base}/ui/", headers={"host": host, "sec-fetch-site": "none"}).status_code == 200
    with connect(stream, origin=Origin(f"http://127.0.0.1:{port}"), proxy=None) as trainer_socket:
        pushed = orjson.loads(trainer_socket.recv(timeout=10))
        assert pushed["type"] == "turns" and [t["id"] for t in pushed["turns"]] == [turn.id]
    # (the socket's lease ended with it: the turn is back in the queue)
    reply = {"replies": [{"turn_id": turn.id, "message": {"content": "from the trainer"}}]}
    answered = httpx.post(f"{base}/api/turns/replies", content=orjson.dumps(reply), headers=json_type)
    assert answered.status_code == 200 and answered.json()["results"][0]["status"] == 200, answered.text
    assert answer.result(timeout=10) == "from the trainer"


def test_a_trainer_post_with_a_body_must_say_it_is_json_whatever_the_door(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    headers = {"authorization": f"Bearer {server.token}"}
    reward = orjson.dumps({"name": "r", "value": 1.0})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        sent = {**headers, "content-type": content_type} if content_type else headers
        response = httpx.post(f"{server.url}/api/episodes/{episode.id}/rewards", content=reward, headers=sent)
        assert response.status_code == 415, (content_type, response.text)
        assert "application/json" in response.json()["error"]["message"]
    for content_type in ("application/json", "application/json; charset=utf-8", "application/merge-patch+json"):
        sent = {**headers, "content-type": content_type}
        response = httpx.post(f"{server.url}/api/episodes/{episode.id}/rewards", content=reward, headers=sent)
        assert response.status_code == 201, (content_type, response.text)
    assert len(trainer.trajectory(episode.id).rewards) == 3


@pytest.mark.parametrize("door", ["token", "open"])
def test_the_urls_handed_to_agents_come_from_the_servers_address_never_the_host_header(
    make_server: Callable[..., Any], door: str
) -> None:
    server = make_server(no_trainer_token=True) if door == "open" else make_server()
    port = urlsplit(server.url).port
    headers = {"authorization": f"Bearer {server.token}"} if server.token else {}
    # With a token, any Host; without one, only a loopback name gets this far.
    host = f"{REBOUND}:{port}" if server.token else f"localhost:{port}"
    created = httpx.post(f"{server.url}/api/episodes", json={"task": "t"}, headers={**headers, "host": host})
    assert created.status_code == 201, created.text
    env = created.json()["env"]
    assert env["OPENAI_BASE_URL"] == f"{server.url}/v1" and env["ANTHROPIC_BASE_URL"] == server.url, env
