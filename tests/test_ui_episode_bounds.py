"""The episode page is bounded whatever the episode's size: its turns are read a page at a time, only the first and
the last are shown (the rest counted), long texts are cut with their full size said, so that a long episode's page
takes memory of about a short one's; and a branch tree nested hundreds deep lays out."""

from __future__ import annotations

import random
import re
import string
import threading
import time
import tracemalloc
from typing import Any

import httpx
import openai
import pytest

from proxy.client import TrainerClient
from proxy.http.ui.conversation import READ, SHOWN, TEXT
from tests.conftest import LiveServer


def episode_of(trainer: TrainerClient, conversations: list[list[Any]]) -> str:
    """An episode whose agent makes one call per conversation given, each answered "ok" by the trainer."""
    episode = trainer.create_episode()

    def agent() -> None:
        with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
            for messages in conversations:
                client.chat.completions.create(model="m", messages=messages)

    calling = threading.Thread(target=agent)
    calling.start()
    answered, deadline = 0, time.monotonic() + 120
    while answered < len(conversations):
        assert time.monotonic() < deadline, f"only {answered} of {len(conversations)} calls reached the trainer"
        for turn in trainer.next_turns(max=8, wait_s=2):
            trainer.reply(turn.id, content="ok")
            answered += 1
    calling.join(30)
    return episode.id


def page(server: LiveServer, episode_id: str) -> tuple[httpx.Response, int]:
    """The episode's page and the peak of memory traced while it is made."""
    with httpx.Client(headers={"authorization": f"Bearer {server.token}"}, timeout=60) as http:  # made untraced
        tracemalloc.start()
        try:
            shown = http.get(f"{server.url}/ui/episodes/{episode_id}")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert shown.status_code == 200, shown.text[-2000:]
    return shown, peak


def texts(count: int, chars: int, seed: int) -> list[list[Any]]:
    """`count` one-message conversations, each its own text of `chars` letters (each call a branch of its own)."""
    letters = random.Random(seed)
    return [
        [{"role": "user", "content": "".join(letters.choices(string.ascii_letters, k=chars))}] for _ in range(count)
    ]


def test_a_long_episodes_page_takes_memory_of_about_a_short_ones(server: LiveServer, trainer: TrainerClient) -> None:
    chars = 8 * TEXT
    short_id = episode_of(trainer, texts(READ, chars, seed=1))  # a page of turns
    long_id = episode_of(trainer, texts(4 * READ, chars, seed=2))
    short, short_peak = page(server, short_id)
    long, long_peak = page(server, long_id)
    assert long_peak < 2 * short_peak, f"{long_peak / 2**20:.1f} MiB against {short_peak / 2**20:.1f} MiB"
    assert long.text.count('<article class="turn"') == 4 * READ
    assert f"({chars} characters; the first {TEXT} here" in long.text
    assert len(long.text) < 4 * len(short.text) + 100_000


def test_only_the_first_and_last_turns_are_shown_and_the_rest_counted(
    server: LiveServer, trainer: TrainerClient
) -> None:
    one = [{"role": "user", "content": "go"}]
    conversation = [one]
    for k in range(2 * SHOWN + 9):  # one branch, each call extending the one before it
        conversation.append(
            [*conversation[-1], {"role": "assistant", "content": "ok"}, {"role": "user", "content": f"step {k}"}]
        )
    episode_id = episode_of(trainer, conversation)
    last = trainer.trajectory(episode_id).turns[-1]
    trainer.add_reward(episode_id, 1.0, turn_id=last.id)
    shown, _ = page(server, episode_id)
    assert f'<a href="#turn-{last.seq}">turn {last.seq}</a>' in shown.text
    seqs = [int(seq) for seq in re.findall(r'<article class="turn" id="turn-(\d+)"', shown.text)]
    total = len(conversation)
    assert seqs == [*range(SHOWN), *range(total - SHOWN, total)]
    assert f"{total} turns: {total - 2 * SHOWN} between the first and the last are not shown here" in shown.text
    assert f"{total - 2 * SHOWN} turns of this branch not shown here" in shown.text
    assert f"step {SHOWN - 2}" in shown.text and f"step {SHOWN}" not in shown.text


# The tree is laid out from the branches the store reads, the same on either database (their reads are proven on
# both by the store's tests): the page's depth is the point here, on SQLite.
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_branches_nested_three_hundred_deep_lay_out(server: LiveServer, trainer: TrainerClient) -> None:
    depth = 300
    episode_id = episode_of(trainer, texts(depth, 8, seed=3))  # each call opens a branch under the one before
    shown, _ = page(server, episode_id)
    tree = shown.text[
        shown.text.index('<ul class="tree">') : shown.text.index("</section>", shown.text.index('<ul class="tree">'))
    ]
    assert tree.count("<ul") == depth and tree.count("</ul>") == depth
    assert tree.count("<li>") == depth and tree.count("</li>") == depth
    assert f"opened after turn {depth - 2} (branch {depth - 2})" in tree
