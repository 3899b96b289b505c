"""Small sharp edges of the review (issue 49, item 16): bodies that gave 500 are a one-line 400, and a reset of an
episode that does not exist is a 404 at once rather than after its wait."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.client import TrainerClient
from tests.test_bad_bodies import assert_one_line_4xx

GEMINI = "/v1beta/models/m:generateContent"
HI = {"role": "user", "parts": [{"text": "hi"}]}
pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the edges, not the storage


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


@pytest.mark.timeout(30)
def test_a_reset_of_an_unknown_episode_is_a_404_at_once(server: Any) -> None:
    headers = {"authorization": f"Bearer {server.token}"}
    answer = httpx.post(f"{server.url}/api/episodes/ep_nothere/reset?wait=600", headers=headers, timeout=10)
    assert answer.status_code == 404 and "ep_nothere" in answer.json()["error"]["message"]
