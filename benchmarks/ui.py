"""The web page with many episodes: how long the list and one episode take to render, server-side, with 100,000
episodes recorded.

    python benchmarks/ui.py [--episodes 100000] [--repeats 30] [--quick]

The database is filled through SqlStore, as trajproxy records (episodes, two turns each, a reward on most,
statuses and metadata as runs leave them), plus one long coding episode: 40 calls with tool calls and their
output, a compaction opening a second branch, a grader's reward with the agent's diff and output. Then
`trajproxy serve` (SQLite, pinned to one core) serves the pages and this process (the other core) asks for each
`--repeats` times over loopback, after a warm-up: the figure is the whole exchange, an upper bound on the server's
own time. Each page is also checked for what it must show.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).parent))
from harness import HOST, percentile, pin_load, start_server

from proxy.core.values import Episode, EpisodeStatus, Reply, Reward, Turn, TurnStatus, Usage, hash_key, new_id, new_key
from proxy.storage.sql import SqlStore

PORT = 18970
STATUSES = [EpisodeStatus.FINISHED] * 12 + [EpisodeStatus.FAILED] * 5 + [EpisodeStatus.RUNNING] * 2
STATUSES += [EpisodeStatus.CANCELLED]
AGENTS = ("minimal", "codex", "claude-code", "mini-swe-agent")
LONG_CALLS = 40
CHUNK = 5000


def turn(episode_id: str, seq: int, messages: list[Any], reply: dict[str, Any], at: float, branch: int = 0) -> Turn:
    request = {"model": "policy", "messages": messages}
    return Turn(
        id=new_id("tu"),
        episode_id=episode_id,
        seq=seq,
        dialect="chat",
        request=request,
        wire=orjson.dumps(request),
        stream=False,
        status=TurnStatus.ANSWERED,
        created_at=at,
        model="policy",
        deliveries=1,
        leased_at=at + 0.002,
        answered_at=at + 0.4,
        ended_at=at + 0.401,
        reply=Reply(message={"role": "assistant", **reply}, finish_reason="stop", usage=Usage(900 + seq * 40, 60)),
        branch=branch,
    )


def ordinary(i: int, now: float, total: int) -> tuple[Episode, list[Turn], Reward | None]:
    """Episode i of the crowd: two calls, a reward when it ended with one."""
    at = now - (total - i) * 26.0  # a month of runs
    status = STATUSES[i % len(STATUSES)]
    metadata = {"split": "eval" if i % 10 == 0 else "train", "task_id": f"t{i % 500}", "agent": {"name": AGENTS[i % 4]}}
    episode = Episode(new_id("ep"), hash_key(new_key()), f"Fix issue #{i} in the repository", metadata, status, at)
    system = {"role": "system", "content": "You are a coding agent."}
    user = {"role": "user", "content": episode.task}
    ls = {"name": "bash", "arguments": '{"cmd":"ls"}'}
    call = {"tool_calls": [{"id": f"c{i}", "type": "function", "function": ls}]}
    first = turn(episode.id, 0, [system, user], call, at + 1)
    result = {"role": "tool", "tool_call_id": f"c{i}", "content": "README.md\nsrc\ntests"}
    second = turn(episode.id, 1, [system, user, {"role": "assistant", **call}, result], {"content": "Done."}, at + 2)
    reward = None
    if status in (EpisodeStatus.FINISHED, EpisodeStatus.FAILED):
        value = 1.0 if status is EpisodeStatus.FINISHED and i % 3 else 0.0
        reward = Reward(new_id("rw"), episode.id, "tests_passed", value, "grader", at + 3, None, {"verdict": "..."})
    return episode, [first, second], reward


def long_episode(at: float) -> tuple[Episode, list[Turn], Reward]:
    """A coding agent's whole run: 40 calls with tool output, then a compaction (a second branch)."""
    episode = Episode(
        new_id("ep"),
        hash_key(new_key()),
        "The tests of calc fail: fix add()",
        {"split": "train", "agent": {"name": "minimal"}},
        EpisodeStatus.FINISHED,
        at,
    )
    messages: list[Any] = [
        {"role": "system", "content": "You are a careful coding agent. " * 20},
        {"role": "user", "content": episode.task},
    ]
    turns = []
    for seq in range(LONG_CALLS - 1):
        call_id, command = f"call_{seq}", orjson.dumps({"cmd": f"cat f{seq}.py"}).decode()
        reply = {
            "content": f"Step {seq}: looking at the next file.",
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "bash", "arguments": command}}],
        }
        turns.append(turn(episode.id, seq, list(messages), reply, at + 1 + seq * 0.01))
        output = "\n".join(f"line {n} of f{seq}.py: x = compute({n})" for n in range(12))
        messages += [{"role": "assistant", **reply}, {"role": "tool", "tool_call_id": call_id, "content": output}]
    compacted = [{"role": "system", "content": "Summarise the work so far."}, {"role": "user", "content": "Go."}]
    turns.append(turn(episode.id, LONG_CALLS - 1, compacted, {"content": "Fixed add()."}, at + 2, branch=1))
    diff = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"
    info = {"agent_output": "2 passed in 0.01s", "diff": diff}
    return episode, turns, Reward(new_id("rw"), episode.id, "tests_passed", 1.0, "grader", at + 3, None, info)


async def fill(url: str, total: int) -> str:
    """Record `total` episodes, and the long one in the middle of them; returns the long one's id."""
    store = SqlStore(url)
    await store.open()
    now = time.time()
    long_id = ""
    try:
        for start in range(0, total, CHUNK):
            writes = []
            for i in range(start, min(total, start + CHUNK)):
                middle = i == total // 2  # created where its neighbours were
                episode, turns, reward = long_episode(now - total * 13.0 + 1) if middle else ordinary(i, now, total)
                long_id = episode.id if middle else long_id
                writes.append(store.add_episode(episode))
                writes += [store.add_turn(t) for t in turns]
                if reward is not None:
                    writes.append(store.add_reward(reward))
            await asyncio.gather(*writes)
    finally:
        await store.close()
    return long_id


def timed(http: httpx.Client, path: str, repeats: int, must_show: str) -> dict[str, Any]:
    for _ in range(3):  # warm-up
        page = http.get(path)
        assert page.status_code == 200 and must_show in page.text, (path, page.status_code, page.text[:500])
    took = []
    for _ in range(repeats):
        began = time.perf_counter()
        page = http.get(path)
        took.append((time.perf_counter() - began) * 1000)
        assert page.status_code == 200
    return {"p50_ms": statistics.median(took), "p95_ms": percentile(took, 95), "kib": len(page.content) / 1024}


def bench(total: int, repeats: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/ui.db"
        began = time.perf_counter()
        long_id = asyncio.run(fill(url, total))
        print(f"recorded {total:,} episodes in {time.perf_counter() - began:.0f} s", flush=True)
        server = start_server(PORT, url)
        try:
            with httpx.Client(base_url=f"http://{HOST}:{PORT}", timeout=60) as http:
                newest = http.get("/ui/").text
                deep = http.get("/ui/", params={"after": f"{time.time() - total * 26.0 / 2}~ep_"}).text
                assert "Older" in newest and "Older" in deep
                pages = [
                    ("the list, newest page", "/ui/", "Fix issue"),
                    ("the list, a page halfway back (keyset)", f"/ui/?after={time.time() - total * 13.0}~ep_", "Fix"),
                    ("the list, status=failed", "/ui/?status=failed", "failed"),
                    ("the list, metadata split=eval (1 in 10)", "/ui/?where=split%3Deval", "Fix issue"),
                    ("the list, metadata task_id=t7 (1 in 500)", "/ui/?where=task_id%3Dt7", "Fix issue"),
                    ("the list, metadata that no episode has", "/ui/?where=split%3Dnone", "No episodes"),
                    ("the list, reward from 0.5", "/ui/?min_reward=0.5", "Fix issue"),
                    (f"one episode: {LONG_CALLS} calls, tool calls, 2 branches", f"/ui/episodes/{long_id}", "branch 1"),
                    ("one episode: 2 calls", "/ui/episodes/" + _an_episode(newest), "Done."),
                    ("the queue", "/ui/queue", "Nothing is waiting"),
                    ("GET /metrics", "/metrics", "trajproxy_episodes"),
                ]
                rows = [{"page": name, **timed(http, path, repeats, shown)} for name, path, shown in pages]
        finally:
            server.terminate()
            server.wait()
    return rows


def _an_episode(page: str) -> str:
    marker = 'href="/ui/episodes/'
    start = page.index(marker) + len(marker)
    return page[start : page.index('"', start)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=30, help="requests of each page (after 3 to warm up)")
    parser.add_argument("--quick", action="store_true", help="a smoke: 2,000 episodes, 5 requests a page")
    args = parser.parse_args()
    total, repeats = (2000, 5) if args.quick else (args.episodes, args.repeats)
    pin_load()
    rows = bench(total, repeats)
    print(f"\n### The web page with {total:,} episodes (SQLite, `ui.py`)\n")
    print("| page | p50 ms | p95 ms | KiB |\n|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['page']} | {row['p50_ms']:.1f} | {row['p95_ms']:.1f} | {row['kib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
