"""The web page in a real browser (Debian's Chromium, driven by selenium): log in, list episodes, open one with tool
calls and two branches, answer a parked turn by hand while a real `openai` SDK agent waits on it, add a reward.

Screenshots go to a temporary folder, or to docs/ (docs/ui.md shows them) with TRAJPROXY_SCREENSHOTS=docs.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions as shows
from selenium.webdriver.support.ui import WebDriverWait

from proxy.client import TrainerClient

ROOT = Path(__file__).parent.parent
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
TOOLS: list[ChatCompletionFunctionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the repository",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        },
    }
]
SYSTEM = "You are a careful coding agent. Use the bash tool to inspect and change the repository."
TASK = "The tests of calc fail: `add(2, 2)` returns 0. Fix add() in calc.py."
OUTPUTS = {
    "pytest -q": "F.\n=== FAILURES ===\n    assert add(2, 2) == 4\nE   assert 0 == 4\n1 failed, 1 passed in 0.02s",
    "sed -i 's/a - b/a + b/' calc.py": "",
}
DIFF = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite only: what the browser sees does not depend on the database (test_ui_http runs both)."""
    return f"sqlite:///{tmp_path}/trajproxy.db"


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    if CHROMIUM is None or DRIVER is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser tests: .ci/run installs chromium and chromium-driver")
        pytest.skip("no Chromium: apt-get install chromium chromium-driver (bash .ci/run does)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def shots(tmp_path: Path) -> Callable[[WebDriver, str], None]:
    folder = ROOT / "docs" if os.environ.get("TRAJPROXY_SCREENSHOTS") == "docs" else tmp_path

    def shoot(driver: WebDriver, name: str) -> None:
        path = folder / f"{name}.png"
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1280, min(max(int(height), 700), 2400))
        assert driver.save_screenshot(str(path))
        assert path.read_bytes().startswith(b"\x89PNG")
        driver.set_window_size(1280, 1000)

    return shoot


def wait(driver: WebDriver, timeout_s: float = 10) -> WebDriverWait[WebDriver]:
    """Waits that read again when what they found went stale: the lists refresh themselves every two seconds, and a
    form's post navigates away from the page an element was found on."""
    return WebDriverWait(driver, timeout_s, ignored_exceptions=(StaleElementReferenceException,))


def log_in(driver: WebDriver, server: Any, path: str = "/ui/") -> None:
    driver.get(server.url + path)
    wait(driver).until(shows.presence_of_element_located((By.ID, "token")))
    assert "/ui/login" in driver.current_url and server.token not in driver.current_url
    driver.find_element(By.ID, "token").send_keys(server.token)
    driver.find_element(By.ID, "login").click()
    # Not url_contains(path) alone: the login page's own address holds "/ui/" already, before its form is posted.
    wait(driver).until(lambda d: "/ui/login" not in d.current_url and path in d.current_url)
    cookie = driver.get_cookie("trajproxy_ui")
    assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert server.token not in cookie["value"]


def coding_agent(episode: Any) -> list[Any]:
    """A small coding agent on the real SDK: a tool loop until the model stops, then a compaction (a new
    conversation, so a second branch)."""
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        while True:
            message = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                assert call.type == "function"
                output = OUTPUTS[json.loads(call.function.arguments)["cmd"]]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        summary: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": "Summarise the work in one line."},
            {"role": "user", "content": "Go."},
        ]
        client.chat.completions.create(model="policy", messages=summary)
        return messages


def answer(trainer: TrainerClient, episode_id: str, **reply: Any) -> None:
    [turn] = trainer.next_turns(episode=episode_id, wait_s=10)
    trainer.reply(turn.id, **reply)


def recorded_run(trainer: TrainerClient, background: Callable[..., Future[Any]]) -> Any:
    """An episode as a coding agent leaves it: tool calls, two branches, a grader's reward with output and diff."""
    episode = trainer.create_episode(task=TASK, metadata={"agent": {"name": "minimal"}, "split": "train"})
    agent = background(coding_agent, episode)
    for command in OUTPUTS:
        answer(trainer, episode.id, tool_calls=[{"function": {"name": "bash", "arguments": {"cmd": command}}}])
    answer(trainer, episode.id, content="Fixed: add() subtracted; it adds now, and the tests pass.")
    answer(trainer, episode.id, content="Ran the tests, found add() subtracting, fixed it.")
    agent.result(timeout=10)
    info = {"grader": {"verdict": "2 passed"}, "agent_output": "2 passed in 0.01s", "diff": DIFF}
    trainer.add_reward(episode.id, 1.0, "tests_passed", source="grader", info=info)
    trainer.finish(episode.id, "finished", "2 passed")
    return episode


def test_list_episodes_and_open_one_with_tool_calls_and_two_branches(
    server: Any,
    trainer: TrainerClient,
    browser: WebDriver,
    background: Callable[..., Future[Any]],
    shots: Callable[[WebDriver, str], None],
) -> None:
    episode = recorded_run(trainer, background)
    for task, status, reward in (("Make the parser accept tabs", "failed", 0.0), ("Add a --version flag", None, None)):
        made = trainer.create_episode(task=task, metadata={"agent": {"name": "claude-code"}, "split": "train"})
        if reward is not None:
            trainer.add_reward(made.id, reward, "tests_passed", source="grader")
        if status is not None:
            trainer.finish(made.id, status, "1 failed")
    other = trainer.create_episode(task="Rename the CLI flag --out to --output", metadata={"split": "eval"})
    log_in(browser, server)
    shown, cells = wait(browser).until(
        lambda d: (
            [a.text for a in d.find_elements(By.CSS_SELECTOR, "#rows tr a.episode")],
            [cell.text for cell in d.find_elements(By.CSS_SELECTOR, "#rows tr:last-child td")],
        )
    )
    assert len(shown) == 4 and shown[0] == other.id and shown[-1] == episode.id
    assert cells[1:6] == ["finished", TASK, "minimal", "1", "4"]
    shots(browser, "ui-episodes")

    browser.find_element(By.ID, "where").send_keys("split=eval")
    browser.find_element(By.ID, "filter").click()
    wait(browser).until(shows.url_contains("where=split"))
    filtered = wait(browser).until(lambda d: [a.text for a in d.find_elements(By.CSS_SELECTOR, "#rows a.episode")])
    assert filtered == [other.id]

    browser.get(f"{server.url}/ui/episodes/{episode.id}")
    tree = wait(browser).until(shows.presence_of_element_located((By.ID, "tree"))).text
    assert "branch 0: 3 turns" in tree and "branch 1: 1 turn, opened after turn 2 (branch 0)" in tree
    branch = browser.find_element(By.ID, "branch-0")
    assert [tool.text for tool in branch.find_elements(By.CSS_SELECTOR, ".call .tool")] == ["bash", "bash"]
    assert '"cmd": "pytest -q"' in branch.find_element(By.CSS_SELECTOR, ".call pre.args").text
    assert "assert 0 == 4" in branch.find_element(By.CSS_SELECTOR, ".msg.tool").text
    assert SYSTEM in branch.find_element(By.CSS_SELECTOR, ".msg.system").text
    assert "Summarise the work" in browser.find_element(By.ID, "branch-1").text
    assert {b.text for b in browser.find_elements(By.CSS_SELECTOR, ".answered-by")} == {"trainer"}
    assert "+    return a + b" in browser.find_element(By.ID, "diff").text
    assert "2 passed in 0.01s" in browser.find_element(By.ID, "output").text
    assert "tests_passed" in browser.find_element(By.ID, "rewards").text
    shots(browser, "ui-episode")

    browser.find_element(By.CSS_SELECTOR, "#turn-0 a.raw").click()
    raw = json.loads(wait(browser).until(lambda d: d.find_element(By.TAG_NAME, "pre")).text)
    assert raw["request"]["messages"][1]["content"] == TASK
    assert raw["reply"]["message"]["tool_calls"][0]["function"]["name"] == "bash"


def test_answer_a_parked_turn_by_hand_while_an_sdk_agent_waits(
    server: Any,
    trainer: TrainerClient,
    browser: WebDriver,
    background: Callable[..., Future[Any]],
    shots: Callable[[WebDriver, str], None],
) -> None:
    episode = trainer.create_episode(task=TASK, metadata={"agent": {"name": "by hand"}})
    log_in(browser, server, "/ui/queue")
    assert "Nothing is waiting" in browser.find_element(By.ID, "queue").text

    def agent() -> Any:
        with openai.OpenAI(
            base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0, timeout=60
        ) as client:
            messages: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
            return client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)

    waiting = background(agent)

    # The queue shows the call without a reload
    turn_id = wait(browser).until(lambda d: d.find_element(By.CSS_SELECTOR, "#rows a.turn").text)
    assert browser.find_element(By.CSS_SELECTOR, "[data-live=parked]").text == "1"
    shots(browser, "ui-queue")

    def open_turn(driver: WebDriver) -> bool:
        driver.find_element(By.LINK_TEXT, turn_id).click()
        return True

    wait(browser).until(open_turn)

    # A malformed tool call is refused next to the form; nothing is recorded, the agent still waits
    wait(browser).until(shows.presence_of_element_located((By.ID, "answer-form")))
    browser.find_element(By.ID, "content").send_keys("Let me run the tests.")
    browser.find_element(By.CSS_SELECTOR, ".tool-name").send_keys("bash")
    browser.find_element(By.CSS_SELECTOR, ".tool-arguments").send_keys('{"cmd": "pytest -q"')
    browser.find_element(By.ID, "send").click()
    refused = wait(browser).until(shows.presence_of_element_located((By.ID, "refused"))).text
    assert "tool call 1 (bash): the arguments are not JSON" in refused
    assert trainer.turn(turn_id).status == "parked" and trainer.turn(turn_id).reply is None
    assert not waiting.done()
    assert browser.find_element(By.CSS_SELECTOR, ".tool-arguments").get_attribute("value") == '{"cmd": "pytest -q"'
    shots(browser, "ui-answer")

    arguments = browser.find_element(By.CSS_SELECTOR, ".tool-arguments")
    arguments.clear()
    arguments.send_keys('{"cmd": "pytest -q"}')
    browser.find_element(By.ID, "send").click()
    assert wait(browser).until(shows.presence_of_element_located((By.ID, "answered-by"))).text == "human"

    message = waiting.result(timeout=10).choices[0].message
    assert message.content == "Let me run the tests."
    [call] = message.tool_calls
    assert call.function.name == "bash" and json.loads(call.function.arguments) == {"cmd": "pytest -q"}
    recorded = trainer.turn(turn_id)
    assert recorded.status == "answered" and recorded.reply is not None and recorded.reply.answered_by == "human"

    # A reward, added on the episode's page
    browser.get(f"{server.url}/ui/episodes/{episode.id}")
    browser.find_element(By.ID, "reward-value").send_keys("0.75")
    browser.find_element(By.ID, "add-reward").click()
    wait(browser).until(lambda d: "0.75" in d.find_element(By.ID, "rewards").text)
    [reward] = trainer.trajectory(episode.id).rewards
    assert (reward.name, reward.value, reward.source) == ("reward", 0.75, "human")


def test_an_unknown_episode_is_a_page_saying_so(server: Any, browser: WebDriver) -> None:
    log_in(browser, server)
    browser.get(f"{server.url}/ui/episodes/ep_nothing")
    said = wait(browser).until(shows.presence_of_element_located((By.ID, "missing"))).text
    assert said == "There is no episode 'ep_nothing'."
    assert browser.title.startswith("Not found")
