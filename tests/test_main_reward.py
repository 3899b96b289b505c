"""An episode's return is its reward named `reward` (as `trajproxy tasks make`'s verifier writes it, beside its
components `tests`, `regressions` and `style`) wherever a return is given, shown, filtered on or exported; the
components stay visible by name. With none named `reward`, the return is the sum of the episode-level rewards (one
reward, whatever its name, is the return); with none at all, there is no return."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.client import TrainerClient
from sandbox.tasks.task import Grade
from tests.test_export import SYSTEM, TOOLS, lines_of
from tests.test_trainer_api import agent_for
from tests.test_ui_http import page  # noqa: F401 (the page fixture)
from tests.test_ui_summary import rows

# What `trajproxy tasks make`'s verifier wrote for an oracle and for an agent that changed nothing (on tabulate).
GRADED: dict[str, dict[str, float]] = {
    "oracle": {"reward": 1.0, "tests": 1.0, "regressions": 0.0, "style": 1.0},
    "no-op": {"reward": 0.0, "tests": 0.0, "regressions": 0.07, "style": 0.0},
    "named": {"tests_passed": 0.5},  # one reward, not named `reward`: it is the return
    "parts": {"a": 0.25, "b": 0.5},  # several, none named `reward`: their sum
    "none": {},
}
RETURNS = {"oracle": 1.0, "no-op": 0.0, "named": 0.5, "parts": 0.75, "none": None}


@pytest.fixture
def graded(trainer: TrainerClient, background: Any) -> dict[str, str]:
    """An episode per entry of GRADED, each with one call answered with token ids, graded, finished: ids by name."""
    made = {}
    for name, rewards in GRADED.items():
        episode = trainer.create_episode(task=f"fix {name}", metadata={"agent": {"name": "x"}, "task_id": name})
        with agent_for(episode) as agent:
            messages: Any = [SYSTEM, {"role": "user", "content": "fix it"}]
            call = background(agent.chat.completions.create, model="m", messages=messages, tools=TOOLS)
            [parked] = trainer.next_turns(episode=episode.id, wait_s=5)
            ids: dict[str, Any] = {"prompt_token_ids": [1, 2], "completion_token_ids": [3], "logprobs": [-0.5]}
            trainer.reply(parked.id, message={"content": "done"}, **ids)
            call.result(timeout=10)
        for reward, value in rewards.items():
            trainer.add_reward(episode.id, value, reward, source="grader")
        trainer.finish(episode.id)
        made[name] = episode.id
    return made


def test_the_trainer_api_returns_the_main_reward_with_its_components(
    trainer: TrainerClient, graded: dict[str, str]
) -> None:
    for name, episode_id in graded.items():
        last = trainer.reset(episode_id, wait_s=5)
        assert last.last() and last.reward == (RETURNS[name] or 0.0), name
        assert {reward.name: reward.value for reward in last.rewards} == GRADED[name]


def test_the_list_the_page_the_summary_and_the_filters_use_the_main_reward(
    page: httpx.Client,  # noqa: F811
    graded: dict[str, str],
) -> None:
    listed = page.get("/ui/").text
    for name, episode_id in graded.items():
        row = re.search(rf'href="/ui/episodes/{episode_id}">.*?</tr>', listed, re.S)
        assert row, listed[-2000:]
        cells = [
            html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()
            for cell in re.findall(r"<td[^>]*>(.*?)</td>", row[0], re.S)
        ]
        shown = RETURNS[name]
        assert cells[3] == ("" if shown is None else f"{shown:g}"), (name, cells)

    kept = page.get("/ui/", params={"min_reward": "0.5"}).text
    assert {name for name, episode_id in graded.items() if episode_id in kept} == {"oracle", "named", "parts"}
    at_most = page.get("/ui/", params={"max_reward": "0.5"}).text
    assert {name for name, episode_id in graded.items() if episode_id in at_most} == {"no-op", "named"}

    oracle = page.get(f"/ui/episodes/{graded['oracle']}").text
    assert re.search(r'<dt>Return</dt><dd id="return">1</dd>', oracle), oracle[:3000]
    assert all(f"<td>{component}</td>" in oracle for component in GRADED["oracle"])  # each shown by name
    parts = page.get(f"/ui/episodes/{graded['parts']}").text
    assert '<dd id="return">0.75</dd>' in parts

    summary = page.get("/ui/summary").text
    # five ended; a return above 0 for oracle, named and parts (not no-op's 0.07 regressions); mean over four
    assert rows(summary, "agents") == [["x", "5", "5", "3", "60%", "0.562"]]
    chart = re.search(r'<svg class="chart" id="reward-chart".*?</svg>', summary, re.S)
    assert chart
    titles = dict(re.findall(r"<title>(ep_\w+): ([\d.]+)</title>", chart[0]))
    assert {name: float(titles[graded[name]]) for name in ("oracle", "no-op")} == {"oracle": 1.0, "no-op": 0.0}


@pytest.mark.parametrize("shape", ["chat", "tokens"])
def test_exports_carry_the_main_reward_and_filter_on_it(
    database_url: str, graded: dict[str, str], tmp_path: Path, shape: str
) -> None:
    lines = lines_of(database_url, tmp_path, "--shape", shape)
    by_name = {line["episode_id"]: line for line in lines}
    for name, episode_id in graded.items():
        line = by_name[episode_id]
        assert (line["reward"], line["rewards"]) == (RETURNS[name], GRADED[name]), name
    split = {line["episode_id"]: line for line in lines_of(database_url, tmp_path, "--shape", shape, "--split-reward")}
    assert split[graded["oracle"]]["reward"] == 1.0  # its one trainable line takes the whole return
    kept = lines_of(database_url, tmp_path, "--shape", shape, "--min-reward", "0.5")
    assert {line["episode_id"] for line in kept} == {graded[name] for name in ("oracle", "named", "parts")}


def test_a_runs_grade_has_the_same_return() -> None:
    """`trajproxy run`'s table, results file and mean reward take the grade's return, as the store does."""
    assert {name: Grade(rewards, "").reward for name, rewards in GRADED.items() if rewards} == {
        name: value for name, value in RETURNS.items() if value is not None
    }
