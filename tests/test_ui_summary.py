"""The summary view (/ui/summary): success rate and mean reward per agent and per task, and each episode's return
over time with its running mean, drawn server-side as SVG; over HTTP, and once in the browser, where an episode is
also ended from its page."""

from __future__ import annotations

import html
import re
from typing import Any

import httpx
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions as shows

from proxy.client import TrainerClient
from tests.test_ui import browser, log_in, wait  # noqa: F401 (the browser fixture)
from tests.test_ui_http import page  # noqa: F401 (the page fixture)


def record(trainer: TrainerClient) -> None:
    """Agent a on t1: two of three ended with a return above 0; agent b on t2: one ended at 0.5, one cancelled, one
    still open (counted, neither ended nor rewarded)."""
    for agent, task, status, reward in (
        ("a", "t1", "finished", 1.0),
        ("a", "t1", "failed", 0.0),
        ("a", "t1", "finished", 1.0),
        ("b", "t2", "finished", 0.5),
        ("b", "t2", "cancelled", None),
        ("b", "t2", None, None),
    ):
        metadata = {"agent": {"name": agent}, "task_id": task}
        made = trainer.create_episode(task=f"Fix {task}\nlong text", metadata=metadata)
        if reward is not None:
            trainer.add_reward(made.id, reward, "tests_passed", source="grader")
        if status is not None:
            trainer.finish(made.id, status)


def rows(text: str, table: str) -> list[list[str]]:
    body = re.search(rf'<table class="tallies" id="{table}">.*?<tbody>(.*?)</tbody>', text, re.S)
    assert body, text[-2000:]
    found = re.findall(r"<tr>(.*?)</tr>", body.group(1), re.S)
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row, re.S) for row in found]
    return [[html.unescape(re.sub(r"<[^>]+>|\s+", " ", cell)).strip() for cell in row] for row in cells]


def test_the_summary_tallies_agents_and_tasks_and_draws_the_rewards(
    page: httpx.Client,  # noqa: F811
    trainer: TrainerClient,
) -> None:
    record(trainer)
    shown = page.get("/ui/summary")
    assert shown.status_code == 200 and "6 episodes" in shown.text
    assert rows(shown.text, "agents") == [
        ["a", "3", "3", "2", "67%", "0.667"],
        ["b", "3", "1", "1", "100%", "0.5"],
    ]
    assert [row[:4] for row in rows(shown.text, "tasks")] == [["t1", "3", "3", "2"], ["t2", "3", "1", "1"]]
    chart = re.search(r'<svg class="chart" id="reward-chart".*?</svg>', shown.text, re.S)
    assert chart and "<script" not in chart.group(0)
    points = re.findall(r'<circle class="point" cx="([\d.]+)" cy="([\d.]+)"', chart.group(0))
    assert len(points) == 4  # the rewarded episodes, oldest first: 1, 0, 1, 0.5
    ys = [float(y) for _, y in points]
    assert ys[0] == ys[2] < ys[3] < ys[1]  # SVG's y grows downwards
    assert [float(x) for x, _ in points] == sorted(float(x) for x, _ in points)
    assert re.search(r'<polyline class="mean" points="[\d., ]+"', chart.group(0))

    finished = page.get("/ui/summary", params={"status": "finished"})
    assert [row[:4] for row in rows(finished.text, "agents")] == [["a", "2", "2", "2"], ["b", "1", "1", "1"]]
    listed = page.get("/ui/", params={"status": "finished"}).text
    assert '<a id="summary-link" href="/ui/summary?status=finished">' in listed  # the list's filters carry over
    refused = page.get("/ui/summary", params={"min_reward": "lots"})
    assert refused.status_code == 400 and "minimum reward must be a number" in html.unescape(refused.text)


def test_an_empty_summary_says_so(page: httpx.Client) -> None:  # noqa: F811
    shown = page.get("/ui/summary")
    assert shown.status_code == 200 and "No rewards yet." in shown.text and "No episodes." in shown.text


def test_end_an_episode_and_read_the_summary_in_the_browser(
    server: Any,
    trainer: TrainerClient,
    browser: WebDriver,  # noqa: F811
) -> None:
    record(trainer)
    open_one = trainer.create_episode(task="still going", metadata={"agent": {"name": "c"}})
    log_in(browser, server, f"/ui/episodes/{open_one.id}")
    wait(browser).until(shows.presence_of_element_located((By.ID, "close-reason"))).send_keys("not needed")
    browser.find_element(By.ID, "close-episode").click()  # cancelled, the form's default
    wait(browser).until(lambda d: not d.find_elements(By.ID, "close-form"))
    assert "cancelled" in browser.find_element(By.TAG_NAME, "h1").text
    assert (trainer.episode(open_one.id).status, trainer.episode(open_one.id).reason) == ("cancelled", "not needed")

    browser.find_element(By.LINK_TEXT, "Summary").click()
    chart = wait(browser).until(shows.visibility_of_element_located((By.ID, "reward-chart")))
    assert chart.size["width"] > 300 and len(chart.find_elements(By.CSS_SELECTOR, "circle.point")) == 4
    fills = browser.find_elements(By.CSS_SELECTOR, "#agents svg.bar rect.fill")
    assert [fill.get_attribute("width") for fill in fills] == ["66.7", "100.0"]
    agents = [row.text.split()[0] for row in browser.find_elements(By.CSS_SELECTOR, "#agents tbody tr")]
    assert agents == ["a", "b", "c"]
