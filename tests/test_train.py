"""`trajproxy train` end to end on the CPU: the tiny model served by a real vLLM, the minimal agent in Docker
sandboxes on the example task for two calls an episode (the command's output, the environment's ids, between them and
out of the loss), TRL's GRPO trainer, the weights loaded into vLLM after every step; and a run stopped by SIGTERM
leaves nothing running. The train extra lives in a venv of its own (`.ci/trainer-venv train`), cached."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from proxy.storage.export import Filters, export, source
from proxy.storage.token_ids import unpack
from testkit.vllm_server import build_tiny_model

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tasks" / "calc" / "tasks.jsonl"
# The choice the tiny model learns: one command of three, one of which fixes the bug (examples/train/README.md)
CHOICE = r'```bash\n(ls|pwd|sed -i "s/a - b/a \+ b/" calc\.py)\n```'


@pytest.fixture(scope="module")
def trajproxy_train() -> Iterator[Path]:
    """`trajproxy` in the train extra's venv: $TRAJPROXY_TEST_TRAIN_PYTHON's, else the one .ci/trainer-venv builds."""
    python = os.environ.get("TRAJPROXY_TEST_TRAIN_PYTHON")
    if not python:
        built = subprocess.run(
            ["bash", str(ROOT / ".ci" / "trainer-venv"), "train"], stdout=subprocess.PIPE, text=True, check=True
        )
        python = built.stdout.strip().splitlines()[-1]
    yield Path(python).parent / "trajproxy"


TURNS = 2  # each episode's calls: the second prompt holds the first command's output


def command(train: Path, out: Path, label: str, steps: int, *more: str) -> list[str]:
    return [
        str(train), "train", str(EXAMPLE), "--agent", "minimal", "--model", str(build_tiny_model()),
        "--steps", str(steps), "--group-size", "4", "--max-turns", str(TURNS), "--seed", "0",
        "--sampling", "max_tokens=64", "--sampling", "structured_outputs=" + json.dumps({"regex": CHOICE}),
        "--out", str(out), "--label", label, *more,
    ]  # fmt: skip


def test_trajproxy_train_trains_through_sandboxed_agents_and_serves_each_steps_weights(
    trajproxy_train: Path, tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    out = tmp_path / "run"
    # held out: the example task once more, evaluated at the start and after the last step (--eval-every 2)
    held_out = ["--eval-tasks", str(EXAMPLE), "--eval-every", "2"]
    done = subprocess.run(
        command(trajproxy_train, out, label, 2, *held_out), capture_output=True, text=True, timeout=800
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "TRL currently supports vLLM" not in done.stderr  # vLLM runs in its own process, never through TRL
    lines = [line for line in done.stdout.splitlines() if line.startswith(("step ", "eval "))]
    printed = [line.split(":")[0] if line.startswith("eval ") else " ".join(line.split()[:2]) for line in lines]
    assert printed == ["eval at step 0", "step 1/2", "step 2/2", "eval at step 2"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and len(summary["steps"]) == 2
    evaluations = summary["evaluations"]
    assert [(e["step"], e["tasks"], e["failed"]) for e in evaluations] == [(0, 1, 0), (2, 1, 0)]
    for evaluation in evaluations:
        assert evaluation["rewards"] in ([0.0], [1.0]) and evaluation["pass_rate"] == evaluation["rewards"][0]
    evaluated = [episode for e in evaluations for episode in e["episodes"]]
    for number, step in enumerate(summary["steps"], start=1):
        # every turn answered by the weights of its step
        assert step["policy_versions"] == {f"step-{number - 1}": 4 * TURNS} and step["turns"] == 4 * TURNS
        assert step["trained_ids"] > 0 and step["environment_ids"] > 0  # TRL got the environment's ids at no loss
        assert len(step["rewards"]) == 4 and all(reward in (0.0, 1.0) for reward in step["rewards"])
        assert step["drift"] is not None and step["drift"] < 1e-3  # vLLM serves what the trainer holds
        assert step["moved"] is not None and step["moved"] > 1e-4  # and what it holds changed
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "checkpoint").glob("*.safetensors"))
    said = f"summary {out}/summary.json, plot {out}/reward.png, checkpoint {out}/checkpoint"
    said += f", episodes {out}/trajproxy.db"
    assert done.stdout.splitlines()[-1] == f"trajproxy train: {said}"  # the run's last line says where all is
    # every sampled id recorded as vLLM sampled it, and trained in the export
    with sqlite3.connect(out / "trajproxy.db") as db:
        query = "SELECT reply, token_ids FROM turn WHERE episode_id NOT IN (%s) ORDER BY created_at"
        query %= ",".join("?" * len(evaluated))
        replies = [(json.loads(reply), unpack(ids)[2]) for reply, ids in db.execute(query, evaluated)]
        ended = db.execute("SELECT status, reason FROM episode").fetchall()
        versions = [
            [v for (v,) in db.execute("SELECT policy_version FROM turn WHERE episode_id = ?", (episode,))]
            for episode in evaluated
        ]
    assert versions == [["step-0"] * TURNS, ["step-2"] * TURNS]  # each evaluation answered by its step's weights
    # --max-turns refused each agent's next call: every episode a graded truncation, none failed
    assert len(ended) == 8 + 2, ended
    assert all(status == "finished" and reason.startswith("truncated: ") for status, reason in ended), ended
    assert len(replies) == 2 * 4 * TURNS
    for reply, ids in replies:
        assert list(ids or ()) == reply["served"]["response"]["choices"][0]["token_ids"]
    assert [reply.get("extends_parent") for reply, _ in replies].count(True) == 2 * 4 * (TURNS - 1)
    engine_ = source(f"sqlite:///{out / 'trajproxy.db'}")
    try:
        exported = io.BytesIO()
        export(engine_, exported, "tokens", Filters())
    finally:
        engine_.dispose()
    samples = [json.loads(line) for line in exported.getvalue().splitlines()]
    samples = [sample for sample in samples if sample["episode_id"] not in evaluated]  # the trained episodes
    assert len(samples) == 8 and all(len(s["turns"]) == TURNS for s in samples)
    assert sum(sum(s["loss_mask"]) for s in samples) == sum(len(ids or ()) for _, ids in replies)
    for sample in samples:  # loss on each call's sampled ids, none on the environment's between them
        sampled = {i for span in sample["turns"] for i in range(span["start"], span["end"])}
        assert sample["loss_mask"] == [int(i in sampled) for i in range(len(sample["completion_ids"]))]
        assert sample["turns"][1]["start"] > sample["turns"][0]["end"]
    environment = sum(len(s["completion_ids"]) - sum(s["loss_mask"]) for s in samples)
    assert environment == sum(step["environment_ids"] for step in summary["steps"])  # all of it handed to TRL masked
    assert not engine.containers.list(all=True, filters={"label": label})


def test_sigterm_stops_a_training_run_with_nothing_left_running(
    trajproxy_train: Path, tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    out = tmp_path / "run"
    log = (tmp_path / "train.log").open("w")
    run = subprocess.Popen(command(trajproxy_train, out, label, 50), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not _an_episode_before_its_first_reply(out / "trajproxy.db"):  # mid-rollout, its calls still to come
            assert run.poll() is None, (tmp_path / "train.log").read_text()[-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=120) == 130
    finally:
        if run.poll() is None:
            run.kill()
        log.close()
    said = (tmp_path / "train.log").read_text()
    assert "trajproxy train: stopped" in said and "Traceback" not in said
    assert not engine.containers.list(all=True, filters={"label": label})
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and str(out) in _cmdline(pid)]  # vLLM is gone
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] is False
    with sqlite3.connect(out / "trajproxy.db") as db:
        statuses = {status for (status,) in db.execute("SELECT status FROM episode")}
    assert "running" not in statuses and "cancelled" in statuses  # the episodes in flight were closed, not lost


def _an_episode_before_its_first_reply(database: Path) -> bool:
    """Whether the run's database holds a running episode none of whose calls has been answered yet: it has all its
    model calls (seconds each on the CPU) and its grading still ahead, so a signal sent now finds it in flight. (A
    sandbox being up says less: it may be one whose episode has just ended, being torn down while the trainer steps.)"""
    if not database.exists():
        return False
    query = (
        "SELECT 1 FROM episode WHERE status = 'running' AND NOT EXISTS "
        "(SELECT 1 FROM turn WHERE turn.episode_id = episode.id AND turn.status NOT IN ('parked', 'leased'))"
    )
    try:
        with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5)) as db:
            return db.execute(query).fetchone() is not None
    except sqlite3.OperationalError as e:
        if "no such table" not in str(e):  # anything but tables not made yet
            raise
        return False


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["--steps", "0"], "--steps must be at least 1 (0 with --eval-tasks: evaluate only)"),
        (["--eval-every", "-1"], "--eval-every must be 0 (at the start and the end only) or more"),
        (["--eval-tasks", "/nonexistent/tasks.jsonl"], "--eval-tasks /nonexistent/tasks.jsonl: "),
    ],
)
def test_held_out_options_that_cannot_run_are_refused_in_one_line(
    trajproxy_train: Path, tmp_path: Path, given: list[str], said: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # a folder that looks like a model: nothing is loaded before refusing
    done = subprocess.run(
        [str(trajproxy_train), "train", str(EXAMPLE), "--agent", "minimal", "--model", str(model), *given],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TRAJPROXY_VLLM_PYTHON": sys.executable},
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"trajproxy train: {said}"), line
    assert not (tmp_path / "trajproxy-train").exists()
