"""One agent call traced at run time: the files of `proxy/` whose code runs in the server (its event loop and its
threads) while an agent's call is parked, pulled by a trainer, answered and handed back. They are few, and
`docs/architecture.md` lists exactly them: the document describes what runs."""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import openai
import pytest

from proxy.client import TrainerClient
from proxy.settings import Settings
from tests.conftest import new_token, start_server

ROOT = Path(__file__).resolve().parent.parent
PROXY = str(ROOT / "proxy") + "/"
# The HTTP edge a call crosses is four files (routes, edge, agent, turns), the core nine (broker, retries, recorder,
# values, episodes, branches, open_turns, endings, answers), storage three (writer, prepared, content); this bound keeps
# what has been folded folded.
MOST_FILES = 24


class Tracer:
    """Every file of `proxy/` whose code a thread runs while recording is on, by thread. Installed on every thread
    started after it (the server's, its pools') and on this one."""

    def __init__(self) -> None:
        self.recording = False
        self.ran: dict[int, set[str]] = {}

    def __call__(self, frame: FrameType, event: str, _arg: Any) -> None:
        if self.recording and event == "call":
            filename = frame.f_code.co_filename
            if filename.startswith(PROXY):
                self.ran.setdefault(threading.get_ident(), set()).add(filename[len(str(ROOT)) + 1 :])

    @contextmanager
    def installed(self) -> Iterator[None]:
        threading.setprofile(self)
        sys.setprofile(self)
        try:
            yield
        finally:
            sys.setprofile(None)
            threading.setprofile(None)


def one_call(client: openai.OpenAI, text: str) -> str | None:
    """A small call (under `INLINE_BELOW`, 2 KB): its turn is stored whole in its row, so `proxy/storage/pieces.py`,
    which cuts larger calls into pieces, does not run for it, and the document says so."""
    completion = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": text}])
    return completion.choices[0].message.content


def answer_one(trainer: TrainerClient, episode: str) -> None:
    """The trainer's share of a turn: a batch pull (long-polling), then a batch reply."""
    turns = trainer.next_turns(episode=episode, max=1, wait_s=10)
    assert len(turns) == 1
    results = trainer.reply_many(
        [{"turn_id": turns[0].id, "message": {"content": "hello"}, "lease_id": turns[0].lease_id}]
    )
    assert results[0].status == 200


def traced_call(tmp_path: Path) -> set[str]:
    """The files of `proxy/` the server ran for one agent call, pulled and answered (after a first call, which
    loads what runs once per process)."""
    tracer = Tracer()
    with tracer.installed():
        settings = Settings(_env_file=None, database_url=f"sqlite:///{tmp_path}/trace.db", trainer_token=new_token())
        running = start_server(settings)
        try:
            live = running.live
            with (
                TrainerClient(live.url, token=live.token) as trainer,
                ThreadPoolExecutor(max_workers=1) as agents,
            ):
                episode = trainer.create_episode(task="trace")
                agent = openai.OpenAI(
                    base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0, timeout=10
                )
                ours = {threading.get_ident(), agents.submit(threading.get_ident).result()}
                for traced in (False, True):
                    tracer.recording = traced
                    call = agents.submit(one_call, agent, "hi")
                    answer_one(trainer, episode.id)
                    assert call.result(timeout=10) == "hello"
                    tracer.recording = False
                agent.close()
        finally:
            running.stop()
    return {name for thread, names in tracer.ran.items() if thread not in ours for name in names}


def documented() -> set[str]:
    """The files the architecture document's table of one turn lists."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## One turn", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| *\d+ *\| *`(proxy/[^`]+)`", section, re.MULTILINE))


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    return traced_call(tmp_path_factory.mktemp("trace"))


def test_one_agent_call_runs_through_few_files_of_the_proxy(ran: set[str]) -> None:
    assert {"proxy/http/agent.py", "proxy/core/broker.py", "proxy/dialects/chat.py"} <= ran  # the tracer sees it
    assert len(ran) <= MOST_FILES, sorted(ran)


def test_the_architecture_document_lists_the_files_one_call_runs_through(ran: set[str]) -> None:
    listed = documented()
    assert listed == ran, f"ran but not listed: {sorted(ran - listed)}; listed but not run: {sorted(listed - ran)}"
