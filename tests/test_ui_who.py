"""The page says who did what: the episode's policy by its spec (`vllm:tiny`, not `model:tiny`), the model (not the
trainer) as the answerer of a call it failed, the agent of `--agent oracle` and `--agent-cmd` runs, and the summary
chart's time labels whole, inside the chart."""

from __future__ import annotations

import asyncio
import html
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions as shows

from proxy.client import AsyncTrainerClient, TrainerClient
from sandbox.run.policies import ScriptedPolicy
from sandbox.run.runner import RunConfig, Runner
from sandbox.tasks.task import Task
from testkit.tasks import EXAMPLE
from tests.conftest import LiveServer
from tests.local_sandboxes import LocalSandboxes
from tests.test_runner_inprocess import AGENT_CMD, image, proxy, sandboxes, task  # noqa: F401 (fixtures)
from tests.test_runner_inprocess import pytestmark as needs_unshare
from tests.test_trainer_api import agent_for
from tests.test_ui import browser, log_in, wait  # noqa: F401 (the browser fixture)
from tests.test_ui_http import page  # noqa: F401 (the page fixture)
from tests.test_ui_summary import record


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_page_names_the_policy_by_its_spec(page: httpx.Client, trainer: TrainerClient) -> None:  # noqa: F811
    options = {"api_base": f"http://127.0.0.1:{closed_port()}/v1", "max_tokens": 8}
    served = trainer.create_episode(policy="vllm:tiny", policy_options=options)
    assert re.search(r"<dt>Policy</dt><dd[^>]*>vllm:tiny</dd>", page.get(f"/ui/episodes/{served.id}").text)
    plain = trainer.create_episode()
    assert re.search(r"<dt>Policy</dt><dd[^>]*>trainer</dd>", page.get(f"/ui/episodes/{plain.id}").text)


def test_a_call_the_model_failed_is_answered_by_the_model_not_the_trainer(
    page: httpx.Client,  # noqa: F811
    trainer: TrainerClient,
    background: Any,
) -> None:
    """A trainer forwards a call to `vllm:NAME` with `on_failure: agent`: the server is down, its agent gets the 502
    at once, and the turn records the served policy as what answered it, not the trainer."""
    episode = trainer.create_episode()
    with agent_for(episode) as agent:
        call = background(agent.chat.completions.create, model="m", messages=[{"role": "user", "content": "hi"}])
        [turn] = trainer.next_turns(episode=episode.id, wait_s=5)
        options = {"api_base": f"http://127.0.0.1:{closed_port()}/v1", "max_tokens": 8}
        answered = trainer.forward(turn.id, "vllm:tiny", options, lease_id=turn.lease_id, on_failure="agent")
        with pytest.raises(openai.APIStatusError) as failed:
            call.result(timeout=10)
    assert failed.value.status_code == 502
    reply = answered.reply
    assert reply is not None and reply.error is not None and reply.error.status == 502
    assert reply.answered_by == "vllm:tiny"
    shown = page.get(f"/ui/episodes/{episode.id}").text
    assert re.findall(r'<b class="answered-by">([^<]*)</b>', shown) == ["vllm:tiny"]


@needs_unshare
def test_the_agent_of_an_oracle_or_agent_cmd_run_is_named(
    proxy: LiveServer,  # noqa: F811
    sandboxes: LocalSandboxes,  # noqa: F811
    task: Task,  # noqa: F811
) -> None:
    async def run(**config: Any) -> str:
        async with AsyncTrainerClient(proxy.url, proxy.token) as trainer:
            runner = Runner(trainer, sandboxes, ScriptedPolicy(EXAMPLE / "solve.script.jsonl"), RunConfig(**config))
            [outcome] = await runner.run_many([task], concurrency=1)
            return str(outcome.episode_id)

    async def both() -> list[str]:
        return [await run(agent_cmd=AGENT_CMD), await run(oracle=True)]  # the example has no solution: it fails

    by_cmd, by_oracle = asyncio.run(asyncio.wait_for(both(), timeout=60))
    with httpx.Client(base_url=proxy.url, headers={"authorization": f"Bearer {proxy.token}"}, timeout=30) as http:
        listed = http.get("/ui/").text
        agents = {}
        for episode_id in (by_cmd, by_oracle):
            row = re.search(rf'href="/ui/episodes/{episode_id}">.*?</tr>', listed, re.S)
            assert row, listed[-2000:]
            agents[episode_id] = html.unescape(re.findall(r"<td[^>]*>(.*?)</td>", row[0], re.S)[2]).strip()
        summary = http.get("/ui/summary").text
    assert agents == {by_cmd: f"--agent-cmd {AGENT_CMD}", by_oracle: "oracle"}
    assert "(none)" not in summary and '<td class="task" title="oracle">oracle</td>' in summary


def test_the_charts_time_labels_stay_inside_it(page: httpx.Client, trainer: TrainerClient) -> None:  # noqa: F811
    record(trainer)
    chart = re.search(r'<svg class="chart" id="reward-chart".*?</svg>', page.get("/ui/summary").text, re.S)
    assert chart
    labels = re.findall(r'<text class="label time" x="([\d.]+)"[^>]*text-anchor="(\w+)"', chart[0])
    # the first time starts at the first point and the last ends at the last: neither is centred over the edge
    assert [anchor for _, anchor in labels] == ["start", "end"], labels


@pytest.fixture
def recorded(server: Any, trainer: TrainerClient) -> Iterator[Any]:
    record(trainer)
    yield server


def test_the_charts_time_labels_are_whole_in_a_browser(
    recorded: Any,
    browser: WebDriver,  # noqa: F811
    tmp_path: Path,
) -> None:
    log_in(browser, recorded, "/ui/summary")
    chart = wait(browser).until(shows.visibility_of_element_located((By.ID, "reward-chart")))
    width = browser.execute_script("return arguments[0].viewBox.baseVal.width;", chart)
    boxes = [
        browser.execute_script("const b = arguments[0].getBBox(); return [b.x, b.width];", label)
        for label in chart.find_elements(By.CSS_SELECTOR, "text.time")
    ]
    assert len(boxes) == 2 and all(x >= 0 and x + w <= width for x, w in boxes), (boxes, width)
