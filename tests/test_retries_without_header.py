"""A retry from an SDK that does not say it retries (no `x-stainless-retry-count`: the Gemini SDK's) attaches to
the turn its first attempt left open once that attempt is gone, rather than becoming a second turn."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from proxy.client import TrainerClient


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.settings(retry_grace_s=60)
def test_the_same_body_again_after_its_agent_hung_up_is_the_same_turn(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    url = f"{server.url}/e/{episode.key}/v1beta/models/m:generateContent"
    body = {"contents": [{"role": "user", "parts": [{"text": "once"}]}]}
    with pytest.raises(httpx.ReadTimeout):  # no trainer yet: the first attempt gives up, as a client timeout does
        httpx.post(url, json=body, timeout=1)
    with ThreadPoolExecutor(1) as pool:
        again = pool.submit(httpx.post, url, json=body, timeout=60)  # no header saying it is a retry
        turns = trainer.next_turns(max=8, wait_s=30)
        assert len(turns) == 1
        trainer.reply(turns[0].id, content="answered once")
        assert again.result().json()["candidates"][0]["content"]["parts"][0]["text"] == "answered once"
    assert len(trainer.trajectory(episode.id).turns) == 1
