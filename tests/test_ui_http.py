"""The web page over plain HTTP, on SQLite and Postgres: who may see it, its lists' filters and pages, hand answers
refused with their reason (and nothing recorded), errors handed to a waiting agent, downloads."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import httpx
import openai
import orjson
import pytest

from proxy.client import TrainerClient
from proxy.http.ui import Page
from proxy.storage.export import Filters, export, source
from tests.test_ui import TOOLS


@pytest.fixture
def page(server: Any) -> Iterator[httpx.Client]:
    """The page as a client holding the trainer token (as a Bearer header) sees it."""
    with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {server.token}"}, timeout=30) as http:
        yield http


def parked_call(trainer: TrainerClient, background: Callable[..., Future[Any]], **create: Any) -> tuple[Any, Any, str]:
    """An episode whose openai SDK agent waits on a call offering the bash tool: (episode, its future, turn id)."""
    episode = trainer.create_episode(task="by hand", **create)

    def agent() -> Any:
        with openai.OpenAI(
            base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0, timeout=30
        ) as client:
            messages: Any = [{"role": "user", "content": "list the files"}]
            return client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)

    waiting = background(agent)
    deadline = time.monotonic() + 10
    while not (turns := trainer.trajectory(episode.id).turns):
        assert time.monotonic() < deadline, "the agent's call was not parked"
        time.sleep(0.02)
    return episode, waiting, turns[0].id


def refusal(response: httpx.Response) -> str:
    found = re.search(r'<p class="refused"[^>]*>(.*?)</p>', response.text, re.S)
    assert found, response.text[-2000:]
    return found.group(1).replace("&#39;", "'").replace("&#34;", '"').replace("&quot;", '"')


def test_the_page_needs_the_token_and_keeps_it_out_of_urls_and_cookies(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as http:
        first = http.get("/ui/episodes/ep_x")
        assert first.status_code == 303 and first.headers["location"] == "/ui/login?next=/ui/episodes/ep_x"
        assert http.get("/ui/live").status_code == 401
        assert http.post("/ui/episodes/ep_x/rewards", data={"value": "1"}).status_code == 401
        login = http.get("/ui/login")
        assert login.status_code == 200 and 'type="password"' in login.text and "parked" not in login.text
        wrong = http.post("/ui/login", data={"token": "not-it", "next": "/ui/queue"})
        assert wrong.status_code == 401 and "not the trainer token" in wrong.text and "set-cookie" not in wrong.headers
        right = http.post("/ui/login", data={"token": server.token, "next": "https://evil.example/"})
        assert right.status_code == 303 and right.headers["location"] == "/ui/"  # never off this server
        cookie = right.headers["set-cookie"]
        assert all(part in cookie for part in ("HttpOnly", "SameSite=strict", "Path=/ui", "trajproxy_ui="))
        assert server.token not in cookie and server.token not in str(right.headers)
        assert http.get("/ui/").status_code == 200  # the cookie opens the page…
        assert http.get("/api/episodes").status_code == 401  # …and nothing else
        assert http.get("/api/episodes", headers={"authorization": f"Bearer {cookie}"}).status_code == 401
        http.post("/ui/logout")
        assert http.get("/ui/").status_code == 303


@pytest.mark.settings(no_trainer_token=True)
def test_without_a_token_the_page_is_open_as_the_api_is(server: Any) -> None:
    page = httpx.get(f"{server.url}/ui/")
    assert page.status_code == 200 and "Log out" not in page.text


def test_every_asset_comes_from_trajproxy(page: httpx.Client, trainer: TrainerClient) -> None:
    episode = trainer.create_episode(task="look")
    for path in ("/ui/", f"/ui/episodes/{episode.id}", "/ui/queue", "/ui/login"):
        text = page.get(path).text
        sources = re.findall(r"""(?:src|href)=["']([^"']+)["']""", text)
        assert sources and all(s.startswith(("/", "?", "#")) for s in sources), (path, sources)
    for asset in ("/ui/static/ui.css", "/ui/static/ui.js"):
        assert httpx.get(page.base_url.join(asset)).status_code == 200  # no data in them: no token needed


def test_a_post_from_another_site_is_refused_and_nothing_recorded(page: httpx.Client, trainer: TrainerClient) -> None:
    episode = trainer.create_episode(task="t")
    forged = page.post(
        f"/ui/episodes/{episode.id}/rewards", data={"value": "1"}, headers={"origin": "https://evil.example"}
    )
    assert forged.status_code == 403
    assert trainer.trajectory(episode.id).rewards == []
    same = page.post(f"/ui/episodes/{episode.id}/rewards", data={"value": "1"}, headers={"origin": str(page.base_url)})
    assert same.status_code == 303 and len(trainer.trajectory(episode.id).rewards) == 1


def test_the_sandbox_socket_serves_neither_the_page_nor_metrics(proxied: Any) -> None:
    with httpx.Client(transport=httpx.HTTPTransport(uds=proxied.settings.socket_path), base_url="http://x") as http:
        headers = {"authorization": f"Bearer {proxied.token}"}
        assert http.get("/ui/", headers=headers).status_code == 403
        assert http.get("/metrics").status_code == 403


def rows_of(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text[-2000:]
    return re.findall(r'<a class="episode" href="/ui/episodes/([^"]+)"', response.text)


def test_lists_page_by_keyset_and_filter_in_the_database(page: httpx.Client, trainer: TrainerClient) -> None:
    made = [trainer.create_episode(task=f"t{i}", metadata={"split": "a" if i % 2 else "b", "n": i}) for i in range(53)]
    newest_first = [episode.id for episode in reversed(made)]
    trainer.finish(made[1].id, "finished")
    trainer.finish(made[2].id, "failed")
    trainer.add_reward(made[1].id, 0.5)
    trainer.add_reward(made[1].id, 0.25, "style")
    trainer.add_reward(made[2].id, -1.0)
    trainer.add_reward(made[3].id, 1.0, turn_id=None, name="other")

    first = page.get("/ui/")
    assert rows_of(first) == newest_first[:50]
    older = re.search(r'<a id="next" href="([^"]+)"', first.text)
    assert older, "no link to the next page"
    second = page.get("/ui/" + older.group(1).replace("&amp;", "&"))
    assert rows_of(second) == newest_first[50:] and 'id="next"' not in second.text
    assert 'data-refresh="rows"' not in second.text  # only the newest page refreshes itself

    assert rows_of(page.get("/ui/", params={"status": "finished"})) == [made[1].id]
    assert rows_of(page.get("/ui/", params=[("status", "finished"), ("status", "failed")])) == [made[2].id, made[1].id]
    assert rows_of(page.get("/ui/", params={"where": "n=7"})) == [made[7].id]
    assert rows_of(page.get("/ui/", params={"where": "split=a, n=7"})) == [made[7].id]
    assert rows_of(page.get("/ui/", params={"where": "split=b, n=7"})) == []
    assert rows_of(page.get("/ui/", params={"min_reward": "0.8"})) == [made[3].id]
    assert rows_of(page.get("/ui/", params={"min_reward": "0", "max_reward": "0.8"})) == [made[1].id]
    assert rows_of(page.get("/ui/", params={"max_reward": "0"})) == [made[2].id]
    at = trainer.episode(made[50].id).created_at
    assert rows_of(page.get("/ui/", params={"since": str(at)})) == newest_first[:3]
    assert rows_of(page.get("/ui/", params={"until": str(at), "where": "n=49"})) == [made[49].id]
    partial = page.get("/ui/", params={"partial": "rows", "status": "failed"})
    assert "<html" not in partial.text and rows_of(partial) == [made[2].id]

    for params, reason in (
        ({"min_reward": "lots"}, "minimum reward must be a number, not 'lots'"),
        ({"where": "no-equals"}, "metadata filter: 'no-equals': expected key=value"),
        ({"since": "yesterday"}, "since: 'yesterday' is not a date or time"),
        ({"after": "garbage"}, "the page link is broken"),
        ({"status": "asleep"}, "no such status"),
    ):
        bad = page.get("/ui/", params=params)
        assert bad.status_code == 400 and reason in refusal(bad), params


def test_bad_hand_answers_are_refused_with_the_reason_and_nothing_is_recorded(
    page: httpx.Client, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    _, waiting, turn_id = parked_call(trainer, background)
    for form, reason in (
        ({"content": "", "tool_name": "", "tool_arguments": ""}, "write a reply or a tool call"),
        ({"tool_name": "rm", "tool_arguments": "{}"}, "the agent offers no tool 'rm'; it offers bash"),
        ({"tool_name": "bash", "tool_arguments": '["ls"]'}, "the arguments must be a JSON object"),
        ({"tool_name": "", "tool_arguments": '{"cmd": "ls"}'}, "tool call 1 has arguments but no tool name"),
        ({"tool_name": "ba sh", "tool_arguments": "{}"}, "is not a tool name"),
    ):
        refused = page.post(f"/ui/turns/{turn_id}/reply", data=form)
        assert refused.status_code == 400 and reason in refusal(refused), form
    for form, reason in (
        ({"status": "200", "message": "x"}, "the status must be from 400 to 599, not 200"),
        ({"status": "503", "message": " "}, "write the message the agent will get"),
    ):
        refused = page.post(f"/ui/turns/{turn_id}/error", data=form)
        assert refused.status_code == 400 and reason in refusal(refused), form
    assert trainer.turn(turn_id).status == "parked" and not waiting.done()

    handed = page.post(f"/ui/turns/{turn_id}/error", data={"status": "503", "message": "busy", "type": "overloaded"})
    assert handed.status_code == 303
    with pytest.raises(openai.APIStatusError) as caught:
        waiting.result(timeout=10)
    assert caught.value.status_code == 503 and "busy" in str(caught.value)
    recorded = trainer.turn(turn_id)
    assert recorded.reply is not None and recorded.reply.answered_by == "human"
    assert recorded.reply.error is not None and recorded.reply.error.status == 503
    again = page.post(f"/ui/turns/{turn_id}/reply", data={"content": "too late"})
    assert again.status_code == 409 and "already has a different reply" in refusal(again)


def test_unknown_ids_are_pages_saying_so(page: httpx.Client) -> None:
    for path, said in (("/ui/episodes/ep_none", "no episode 'ep_none'"), ("/ui/turns/tu_none", "no turn 'tu_none'")):
        missing = page.get(path)
        assert missing.status_code == 404 and "text/html" in missing.headers["content-type"]
        assert said in refusal(missing)
    assert page.post("/ui/turns/tu_none/reply", data={"content": "x"}).status_code == 404
    assert page.get("/ui/episodes/ep_none/export.jsonl").status_code == 404


def test_a_reward_that_cannot_be_read_is_refused_on_the_page(page: httpx.Client, trainer: TrainerClient) -> None:
    episode = trainer.create_episode(task="t")
    refused = page.post(f"/ui/episodes/{episode.id}/rewards", data={"value": "lots"}, follow_redirects=True)
    assert "the reward must be a number, not 'lots'" in refusal(refused)
    refused = page.post(f"/ui/episodes/{episode.id}/rewards", data={"value": "1", "info": "{"}, follow_redirects=True)
    assert "the info is not JSON" in refusal(refused)
    assert trainer.trajectory(episode.id).rewards == []


def test_downloads_are_the_exports_lines(
    server: Any, page: httpx.Client, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    answered = []
    for split in ("a", "b"):
        episode, waiting, turn_id = parked_call(trainer, background, metadata={"split": split})
        trainer.reply(turn_id, f"files of {split}")
        waiting.result(timeout=10)
        trainer.finish(episode.id, "finished" if split == "a" else "failed")
        answered.append(episode)
    with_a, with_b = answered
    one = page.get(f"/ui/episodes/{with_a.id}/export.jsonl")
    assert one.status_code == 200 and 'filename="' in one.headers["content-disposition"]
    [line] = [orjson.loads(line) for line in one.content.splitlines()]
    assert line["episode_id"] == with_a.id and line["messages"][-1]["content"] == "files of a"

    chosen = page.get("/ui/export.jsonl", params={"status": "failed", "shape": "chat"})
    engine = source(server.settings.database_url)
    try:
        from io import BytesIO

        expected = BytesIO()
        export(engine, expected, "chat", Filters(statuses=("failed",)))
    finally:
        engine.dispose()
    assert chosen.content == expected.getvalue() and with_b.id in chosen.text and with_a.id not in chosen.text
    atif = page.get(f"/ui/episodes/{with_b.id}/export.jsonl", params={"shape": "atif"})
    assert atif.status_code == 200 and orjson.loads(atif.content)["session_id"] == with_b.id
    assert page.get("/ui/export.jsonl", params={"shape": "pdf"}).status_code == 400


def test_live_counts_are_the_brokers(page: httpx.Client, server: Any, trainer: TrainerClient, background: Any) -> None:
    episode, waiting, _ = parked_call(trainer, background)
    health = httpx.get(f"{server.url}/health").json()
    assert page.get("/ui/live").json() == {"parked": 1, "leased": 0, "waiting": health["waiting_pollers"]}
    trainer.finish(episode.id, "cancelled", "the test is over")  # its agent hears so now, not at its 30 s timeout
    with pytest.raises(openai.APIStatusError):
        waiting.result(timeout=10)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_page_is_built_at_its_first_request_not_when_the_server_starts(server: Any) -> None:
    """Most servers never serve the page (a trainer's, a run's): its routes are built when it is first asked for."""
    (mounted,) = {route.serve for route in server.app.table if route.path == "/ui"}
    assert isinstance(mounted, Page) and mounted.app is None
    assert httpx.get(f"{server.url}/api/episodes", headers={"authorization": f"Bearer {server.token}"}).is_success
    assert mounted.app is None
    assert httpx.get(f"{server.url}/ui/login").status_code == 200
    assert mounted.app is not None
