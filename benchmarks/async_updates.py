"""Barrier or keep: what a weight update costs rollouts, with real agents in sandboxes and a real vLLM whose weights
are really rewritten and reloaded every N rollouts.

    python benchmarks/async_updates.py [--rollouts-per-update 4] [--updates 3] [--quick]

Both loops make the same rollouts (the minimal agent, three turns each, on the calc task, in Docker sandboxes, its
calls answered by a served policy in tokens mode) and the same updates (new weights written, as a training step
would, then `reload_weights`):
- barrier: a step's N rollouts run together; the trainer waits for the last, trains, and updates with
  `pause("hold", drain_s)`: nothing runs meanwhile.
- keep: rollouts run all the time, N at once; each time N more have ended the trainer trains and updates with
  `pause("keep")`: rollouts in flight go on (their calls at the server finish on the old weights; the calls made
  meanwhile wait for the reload), and episodes span versions.
It reports rollouts per minute and the share of the wall time the trainer spent waiting for rollouts.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout: tests/
from harness import BIN, HOST, exit_on_sigterm, fresh_database, start_server

from testkit.served_checks import ask
from testkit.vllm_server import VllmServer, build_tiny_model, copy_model, free_port, reload_weights, vllm_python
from testkit.vllm_server import vllm_server as serving

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "examples" / "tasks" / "calc" / "tasks.jsonl"
LOOK_AROUND = r"<think>[a-z]{1,6}</think>\n```bash\n(ls|pwd|cat calc.py)\n```"


def three_turn_agent(folder: Path) -> Path:
    """The minimal agent, given three turns (it is given no way to say it is done)."""
    shutil.copytree(ROOT / "agents" / "minimal", folder / "minimal")
    manifest = (ROOT / "agents" / "minimal.toml").read_text().replace('name = "minimal"', 'name = "minimal-3-turns"')
    (folder / "agent.toml").write_text(manifest.replace("--model {model}", "--model {model} --max-turns 3"))
    return folder / "agent.toml"


class Loop:
    """One trajproxy, one vLLM, and the commands both loops share."""

    def __init__(self, vllm: VllmServer, proxy: str, sockets: Path, agent: Path, scratch: Path) -> None:
        self.vllm, self.proxy, self.sockets, self.agent, self.scratch = vllm, proxy, sockets, agent, scratch
        self.api = httpx.Client(base_url=f"{proxy}/api", timeout=120)
        self.versions = 0
        self.waited_s = 0.0

    def run(self, rollouts: int, concurrency: int) -> subprocess.Popen[bytes]:
        tasks = self.scratch / f"tasks-{rollouts}-{time.monotonic_ns()}.jsonl"
        line = TASK.read_text().strip()
        tasks.write_text("\n".join(line.replace('"label": "', f'"label": "{n} ') for n in range(rollouts)) + "\n")
        options = {"api_base": self.vllm.base_url, "mode": "tokens", "temperature": 1.0, "max_tokens": 64}
        options["structured_outputs"] = {"regex": LOOK_AROUND}
        command = [str(BIN / "trajproxy"), "run", str(tasks), "--agent", str(self.agent)]
        command += ["--policy", f"vllm:{self.vllm.served_name}", "--concurrency", str(concurrency)]
        command += ["--proxy-url", self.proxy, "--socket-source", str(self.sockets)]
        for key, value in options.items():
            command += ["--policy-option", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ended(self) -> int:
        listed = self.api.get("/episodes", params={"limit": 500}).json()
        return sum(episode["status"] in ("finished", "failed") for episode in listed["episodes"])

    def wait_until(self, done: Callable[[], bool]) -> None:
        began = time.monotonic()
        while not done():
            time.sleep(0.1)
        self.waited_s += time.monotonic() - began

    def update(self, mode: str) -> None:
        """A training step's new weights, written where the server reads them, and the update around them."""
        ask(self.vllm.python, self.vllm.model_dir, perturb=self.versions + 1)
        self.api.post("/pause", json={"mode": mode, "drain_s": 60.0 if mode == "hold" else 0.0}).raise_for_status()
        reload_weights(self.vllm)
        self.versions += 1
        self.api.post("/resume", json={"policy_version": f"step-{self.versions}"}).raise_for_status()


def barrier(loop: Loop, per_update: int, updates: int) -> None:
    for _ in range(updates):
        run = loop.run(per_update, per_update)
        loop.wait_until(functools.partial(_exited, run))
        loop.update("hold")


def keep(loop: Loop, per_update: int, updates: int) -> None:
    start = loop.ended()
    run = loop.run(per_update * updates, per_update)
    try:
        for step in range(1, updates + 1):
            loop.wait_until(functools.partial(_ended_since, loop, start, step * per_update))
            loop.update("keep")
        loop.wait_until(functools.partial(_exited, run))
    finally:
        run.terminate()
        run.wait()


def _exited(run: subprocess.Popen[bytes]) -> bool:
    return run.poll() is not None


def _ended_since(loop: Loop, start: int, count: int) -> bool:
    return loop.ended() - start >= count


def measure(way: str, per_update: int, updates: int, database_url: str | None) -> dict[str, Any]:
    python = vllm_python()
    with tempfile.TemporaryDirectory(prefix="async-updates-") as folder:
        scratch = Path(folder)
        sockets = scratch / "sockets"
        sockets.mkdir()
        with (
            serving(copy_model(build_tiny_model(python), scratch / "model"), python, timeout=900) as vllm,
            fresh_database(database_url) as url,
        ):
            port = free_port()
            server = start_server(port, url, pinned=False, flags=["--socket-path", str(sockets / "proxy.sock")])
            try:
                loop = Loop(vllm, f"http://{HOST}:{port}", sockets, three_turn_agent(scratch), scratch)
                began = time.monotonic()
                (barrier if way == "barrier" else keep)(loop, per_update, updates)
                wall = time.monotonic() - began
                rollouts = loop.ended()
                loop.api.close()
            finally:
                server.terminate()
                server.wait()
    return {
        "way": way,
        "rollouts": rollouts,
        "wall_s": wall,
        "rollouts_per_min": rollouts / wall * 60,
        "trainer_waiting": loop.waited_s / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--rollouts-per-update", type=int, default=4)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a short smoke: 2 rollouts per update, 1 update")
    parser.add_argument("--repeats", type=int, default=1, help="accepted for benchmarks/all.py")
    parser.add_argument("--database-url", help="default: a fresh SQLite file")
    args = parser.parse_args()
    if args.quick:
        args.rollouts_per_update, args.updates = 2, 1
    exit_on_sigterm()
    print("way      rollouts  wall s  rollouts/min  trainer waiting", flush=True)
    for way in ("barrier", "keep"):
        r = measure(way, args.rollouts_per_update, args.updates, args.database_url)
        print(
            f"{way:<8} {r['rollouts']:>8} {r['wall_s']:>7.1f} {r['rollouts_per_min']:>13.1f} "
            f"{r['trainer_waiting']:>15.0%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
