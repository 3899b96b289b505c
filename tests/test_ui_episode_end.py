"""On the page: ending an episode from its page (its waiting agent gets the 'episode closed' error), the tools a
parked call offers with their parameters next to the hand-answer form, and the favicon, all from the package."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import httpx
import openai
import pytest

from proxy.client import TrainerClient
from proxy.http.ui.display import offered_tools
from tests.test_ui_http import page, parked_call  # noqa: F401 (the page fixture)


def not_closed(response: httpx.Response) -> str:
    found = re.search(r'<p class="refused" id="not-closed">(.*?)</p>', response.text, re.S)
    assert found, response.text[-2000:]
    return html.unescape(found.group(1))


def test_cancel_an_episode_from_its_page_and_its_waiting_agent_is_told(
    page: httpx.Client,  # noqa: F811
    trainer: TrainerClient,
    background: Callable[..., Future[Any]],
) -> None:
    episode, waiting, turn_id = parked_call(trainer, background)
    shown = page.get(f"/ui/episodes/{episode.id}")
    assert 'id="close-form"' in shown.text and f'action="/ui/episodes/{episode.id}/finish"' in shown.text

    ended = page.post(f"/ui/episodes/{episode.id}/finish", data={"status": "cancelled", "reason": "stuck in a loop"})
    assert ended.status_code == 303 and ended.headers["location"] == f"/ui/episodes/{episode.id}"
    recorded = trainer.episode(episode.id)
    assert (recorded.status, recorded.reason) == ("cancelled", "stuck in a loop")
    with pytest.raises(openai.APIStatusError) as refused:
        waiting.result(timeout=10)
    assert "stuck in a loop" in str(refused.value)
    assert trainer.turn(turn_id).status == "failed"
    after = page.get(f"/ui/episodes/{episode.id}")
    assert 'id="close-form"' not in after.text and "stuck in a loop" in after.text

    again = page.post(f"/ui/episodes/{episode.id}/finish", data={"status": "finished"}, follow_redirects=True)
    assert again.status_code == 200 and "already cancelled" in not_closed(again)
    assert trainer.episode(episode.id).status == "cancelled"


def test_ending_an_episode_refuses_what_it_cannot_use(page: httpx.Client, trainer: TrainerClient) -> None:  # noqa: F811
    episode = trainer.create_episode(task="end me")
    bad = page.post(f"/ui/episodes/{episode.id}/finish", data={"status": "done"}, follow_redirects=True)
    assert "finished, failed or cancelled, not 'done'" in not_closed(bad)
    long = page.post(f"/ui/episodes/{episode.id}/finish", data={"status": "failed", "reason": "x" * 2001})
    assert "reason" in not_closed(page.get(long.headers["location"]))
    cross = page.post(f"/ui/episodes/{episode.id}/finish", data={"status": "failed"}, headers={"origin": "http://a.b"})
    assert cross.status_code == 403
    missing = page.post("/ui/episodes/ep_nothing/finish", data={"status": "failed"})
    assert missing.status_code == 404 and "There is no episode" in missing.text
    assert trainer.episode(episode.id).status == "pending"  # nothing was recorded

    finished = page.post(f"/ui/episodes/{episode.id}/finish", data={"status": "finished"})
    assert finished.status_code == 303 and trainer.episode(episode.id).status == "finished"


def test_the_answer_form_shows_each_tools_parameters(
    page: httpx.Client,  # noqa: F811
    trainer: TrainerClient,
    background: Callable[..., Future[Any]],
) -> None:
    episode, _waiting, turn_id = parked_call(trainer, background)
    text = page.get(f"/ui/turns/{turn_id}").text
    assert '<li class="param"><code>cmd</code> <i>string</i>, required</li>' in text
    assert "<code>bash</code>(cmd)" in text  # next to the form too
    trainer.finish(episode.id, "cancelled")


def test_tools_parameters_are_read_from_their_schema() -> None:
    schema = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "where"},
            "mode": {"enum": ["r", "w"]},
            "depth": {"type": ["integer", "null"]},
        },
        "required": ["path"],
    }
    request = {"tools": [{"type": "function", "function": {"name": "read", "parameters": schema}}, "junk"]}
    [tool] = offered_tools(request)
    assert tool.name == "read"
    assert [(p.name, p.kind, p.required, p.description) for p in tool.parameters] == [
        ("path", "string", True, "where"),
        ("mode", 'one of "r", "w"', False, ""),
        ("depth", "integer or null", False, ""),
    ]


def test_the_page_has_a_favicon_from_the_package(page: httpx.Client) -> None:  # noqa: F811
    text = page.get("/ui/").text
    [icon] = re.findall(r'<link rel="icon" href="([^"]+)"', text)
    assert icon.startswith("/ui/static/")
    served = page.get(icon)
    assert served.status_code == 200 and served.headers["content-type"].startswith("image/svg+xml")
    assert served.content.startswith(b"<svg")
