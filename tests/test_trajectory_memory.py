"""A long episode's trajectory is sent a page of turns at a time: reading it takes memory of about a page, not of
the episode (four times the turns, about the same peak), and the JSON is the same as read whole."""

from __future__ import annotations

import hashlib
import random
import string
import threading
import time
import tracemalloc
from typing import Any

import httpx
import openai
import orjson

from proxy.client import TrainerClient
from tests.conftest import LiveServer

TEXT_CHARS = 256 * 1024


def episode_of(trainer: TrainerClient, calls: int, seed: int) -> tuple[str, list[str]]:
    """An episode of `calls` turns, each a call with its own text of TEXT_CHARS letters."""
    episode = trainer.create_episode()
    letters = random.Random(seed)
    texts = ["".join(letters.choices(string.ascii_letters, k=TEXT_CHARS)) for _ in range(calls)]

    def agent() -> None:
        with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
            for text in texts:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])

    calling = threading.Thread(target=agent)
    calling.start()
    answered, deadline = 0, time.monotonic() + 120
    while answered < calls:
        assert time.monotonic() < deadline, f"only {answered} of {calls} calls reached the trainer"
        for turn in trainer.next_turns(max=8, wait_s=2):
            trainer.reply(turn.id, content="ok")
            answered += 1
    calling.join(30)
    return episode.id, texts


def read(server: LiveServer, episode_id: str) -> tuple[int, int, bytes]:
    """The trajectory's size, the peak of memory traced while it is read and sent, and its sha256."""
    url = f"{server.url}/api/episodes/{episode_id}/trajectory"
    streamed, size = hashlib.sha256(), 0
    with httpx.Client(headers={"authorization": f"Bearer {server.token}"}, timeout=60) as http:  # made untraced
        tracemalloc.start()
        try:
            with http.stream("GET", url) as answer:
                for chunk in answer.iter_raw():
                    streamed.update(chunk)
                    size += len(chunk)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    return size, peak, streamed.digest()


def test_a_long_trajectory_is_read_in_memory_of_about_a_page(server: LiveServer, trainer: TrainerClient) -> None:
    short_id, _ = episode_of(trainer, 8, seed=1)
    long_id, texts = episode_of(trainer, 32, seed=2)
    short_size, short_peak, _ = read(server, short_id)
    long_size, long_peak, digest = read(server, long_id)
    assert long_size > 3.9 * short_size
    assert long_peak < 2 * short_peak, f"{long_peak / 2**20:.1f} MiB against {short_peak / 2**20:.1f} MiB"

    whole = httpx.get(
        f"{server.url}/api/episodes/{long_id}/trajectory", headers={"authorization": f"Bearer {server.token}"}
    ).content
    assert hashlib.sha256(whole).digest() == digest
    trajectory: Any = orjson.loads(whole)
    assert [turn["request"]["messages"][0]["content"] for turn in trajectory["turns"]] == texts
    assert trajectory["episode"]["id"] == long_id and trajectory["rewards"] == []
    assert trainer.trajectory(long_id).turns[-1].request["messages"][0]["content"] == texts[-1]
