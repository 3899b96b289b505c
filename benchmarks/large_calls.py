"""Large calls: what a server holds after answering many calls of a coding agent's size (a long context is a
megabyte or so), and whether it stops growing.

    python benchmarks/large_calls.py --calls 300 --size-kib 1024 [--database-url URL]

One agent sends `--calls` chat completions one after another, each with a system prompt of `--size-kib` KiB; one
trainer long-polls and answers each at once, with usage (so no token encoding is loaded). The server's VmRSS is
read from /proc every 50 calls, and once more after the episode is finished ("done"). Nothing is pinned: this
measures memory, not speed.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from capacity import memory_kib
from harness import HOST, fresh_database, start_server

REPLY = {"message": {"content": "ok"}, "usage": {"prompt_tokens": 1, "completion_tokens": 1}}


def answer_until(stop: threading.Event, base: str) -> None:
    with httpx.Client(base_url=base, timeout=30) as trainer:
        while not stop.is_set():
            turns = trainer.get("/api/turns/next", params={"max": 16, "wait": 0.5}).json()["turns"]
            if turns:
                replies = [{"turn_id": turn["id"], **REPLY} for turn in turns]
                trainer.post("/api/turns/replies", json={"replies": replies}).raise_for_status()


def bench(calls: int, size_kib: int, database_url: str | None, port: int) -> list[tuple[int | str, float]]:
    """(calls answered, server VmRSS MiB) before the first call, after every 50, and after the episode's finish."""
    with fresh_database(database_url) as url:
        server = start_server(port, url, pinned=False)
        stop = threading.Event()
        base = f"http://{HOST}:{port}"
        trainer = threading.Thread(target=answer_until, args=(stop, base), daemon=True)
        try:
            episode = httpx.post(f"{base}/api/episodes", json={"task": "large calls"}).json()
            key = episode["key"]
            trainer.start()
            samples: list[tuple[int | str, float]] = [(0, memory_kib(server.pid)["VmRSS"] / 1024)]
            system = {"role": "system", "content": "x" * (size_kib * 1024)}
            with httpx.Client(base_url=base, timeout=60, headers={"authorization": f"Bearer {key}"}) as agent:
                for n in range(1, calls + 1):
                    body = {"model": "policy", "messages": [system, {"role": "user", "content": f"call {n}"}]}
                    agent.post("/v1/chat/completions", json=body).raise_for_status()
                    if n % 50 == 0 or n == calls:
                        samples.append((n, memory_kib(server.pid)["VmRSS"] / 1024))
            httpx.post(f"{base}/api/episodes/{episode['id']}/finish", json={}).raise_for_status()
            samples.append(("done", memory_kib(server.pid)["VmRSS"] / 1024))
            return samples
        finally:
            stop.set()
            trainer.join(5)
            server.send_signal(signal.SIGINT)
            server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--size-kib", type=int, default=1024, help="the system prompt of each call")
    parser.add_argument("--database-url", help="a Postgres (a scratch schema per run; default: a fresh SQLite file)")
    parser.add_argument("--port", type=int, default=18750)
    parser.add_argument("--quick", action="store_true", help="a short smoke: 60 calls of 256 KiB")
    args = parser.parse_args()
    calls, size_kib = (60, 256) if args.quick else (args.calls, args.size_kib)
    samples = bench(calls, size_kib, args.database_url, args.port)
    print(f"calls of {size_kib} KiB answered, and the server's VmRSS (MiB):")
    print("  ".join(f"{n}: {rss:.0f}" for n, rss in samples))


if __name__ == "__main__":
    main()
