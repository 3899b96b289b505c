"""The environment side of examples/rl/grpo.py: the colour tasks, `trajproxy serve` on a free port, the unmodified
agent run once per episode through trajproxy's served policy, and the grader that rewards its answer."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from integrations.train.vllm import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TRAJPROXY = REPO / ".venv" / "bin" / "trajproxy"  # the project's, as .ci/run makes it
AGENT = HERE / "agent.py"
SERVED_NAME = "tiny"
COLOURS = ("red", "green", "blue")


@dataclass(frozen=True)
class Task:
    question: str
    target: str  # the colour that earns the reward


# The questions share few words, so that even a tiny random model's last hidden state tells them apart (two
# questions that differ in one word of thirty look the same to it, and it learns one colour for both).
TASKS = (
    Task("What colour is the sky on a clear summer day?", "blue"),
    Task("Grass, leaves and trees in spring: which colour?", "green"),
    Task("Ripe strawberries and fire trucks, what colour are they?", "red"),
)


@dataclass
class Rollout:
    task: int
    episode_id: str
    answer: str
    reward: float
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # vLLM's, one per sampled id, as recorded
    policy_version: str | None
    advantage: float = 0.0


class Trajproxy:
    """The few trainer-API calls this needs, on plain httpx."""

    def __init__(self, url: str, token: str) -> None:
        self.http = httpx.Client(
            base_url=url.rstrip("/") + "/api", headers={"Authorization": f"Bearer {token}"}, timeout=120
        )

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        answer = self.http.request(method, path, json=body)
        if answer.is_error:
            raise RuntimeError(f"trajproxy: {method} /api{path} answered {answer.status_code}: {answer.text[:500]}")
        return answer.json()

    def close(self) -> None:
        self.http.close()


# --- the servers ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def trajproxy_server(token: str, folder: Path) -> Iterator[str]:
    """`trajproxy serve` from the project's .venv, on a free port, SQLite in `folder`; stopped on exit."""
    port = free_port()
    log = open(folder / "trajproxy.log", "wb")  # noqa: SIM115 (closed below)
    command = [
        str(TRAJPROXY), "serve", "--port", str(port),
        "--database-url", f"sqlite:///{folder}/trajproxy.db", "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TRAJPROXY_TRAINER_TOKEN": token},
        start_new_session=True,  # stopped by us, not by the terminal's Ctrl-C, so nothing is cut mid-write
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"trajproxy exited with {proc.returncode}: {(folder / 'trajproxy.log').read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("trajproxy did not answer /health in 60 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# --- rollouts and grading ---------------------------------------------------------------------------------------

_agents: set[subprocess.Popen[str]] = set()  # running agents, killed if the run is stopped
_agents_lock = threading.Lock()


def run_agent(python: str, question: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = subprocess.Popen(
        [python, str(AGENT), question],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env},
    )  # fmt: skip
    with _agents_lock:
        _agents.add(proc)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        with _agents_lock:
            _agents.discard(proc)
    return proc.returncode, out, err


def rollout(api: Trajproxy, task_index: int, seed: int, options: dict[str, Any], agent_python: str) -> Rollout:
    """One episode: the agent answers through trajproxy and the served policy; the grader rewards its answer."""
    task = TASKS[task_index]
    episode = api.call(
        "POST", "/episodes",
        {"task": task.question, "metadata": {"target": task.target}, "policy": f"vllm:{SERVED_NAME}",
         "policy_options": {**options, "seed": seed}},
    )  # fmt: skip
    code, out, err = run_agent(agent_python, task.question, episode["env"])
    if code != 0:
        api.call("POST", f"/episodes/{episode['id']}/finish", {"status": "failed", "reason": "agent-error"})
        raise RuntimeError(f"the agent failed ({code}): {err[-2000:]}")
    answer = out.strip()
    reward = 1.0 if answer == task.target else 0.0
    api.call(
        "POST", f"/episodes/{episode['id']}/rewards",
        {"name": "correct", "value": reward, "source": "grader", "info": {"answer": answer}},
    )  # fmt: skip
    api.call("POST", f"/episodes/{episode['id']}/finish", {"status": "finished", "reason": "graded"})
    trajectory = api.call("GET", f"/episodes/{episode['id']}/trajectory")
    [turn] = trajectory["turns"]  # the agent makes one call
    reply = turn["reply"]
    if (((reply or {}).get("message") or {}).get("content") or "").strip() != answer:
        raise RuntimeError(f"episode {episode['id']}: the agent printed {answer!r}, the turn recorded {reply}")
    if reply is None or reply["completion_token_ids"] is None or reply["logprobs"] is None:
        raise RuntimeError(f"episode {episode['id']}: its turn has no token ids or logprobs: {turn}")
    return Rollout(
        task=task_index,
        episode_id=episode["id"],
        answer=answer,
        reward=reward,
        prompt_ids=reply["prompt_token_ids"],
        completion_ids=reply["completion_token_ids"],
        logprobs=reply["logprobs"],
        policy_version=reply["policy_version"],
    )


def kill_agents() -> None:
    with _agents_lock:
        running = list(_agents)
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
