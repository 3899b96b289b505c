"""count_tokens under an agent's flood: concurrent counts of large bodies under one episode key, with /health polled
meanwhile. Reports the server's peak memory (VmHWM), the slowest /health answer, and the counts' statuses.

    .venv/bin/python benchmarks/count_tokens.py [--calls 8] [--mib 6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent  # this checkout's proxy, whichever is installed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def main(calls: int, mib: int) -> None:
    port = free_port()
    folder = tempfile.mkdtemp()
    command = [sys.executable, "-c", "from proxy.cli.main import main; main()", "serve", "--port", str(port)]
    command += ["--no-trainer-token", "--database-url", f"sqlite:///{folder}/b.db"]
    env = {**os.environ, "TRAJPROXY_LOG_LEVEL": "warning"}
    server = subprocess.Popen(command, cwd=ROOT, env=env)  # noqa: ASYNC220 (started once, before any load)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            while True:
                try:
                    await http.get("/health")
                    break
                except httpx.TransportError:
                    if server.poll() is not None:
                        raise SystemExit("the server did not start") from None
                    await asyncio.sleep(0.1)
            key = (await http.post("/api/episodes", json={})).json()["key"]
            text = "the quick brown fox " * (mib * 2**20 // 20)
            body = orjson.dumps({"model": "claude", "messages": [{"role": "user", "content": text}]})
            await http.post("/v1/messages/count_tokens", content=b"{}", headers={"x-api-key": key})  # warm
            before = peak_mib(server.pid)
            slowest = 0.0
            done = threading.Event()

            def poll() -> None:  # a thread of its own: this loop is busy sending the bodies
                nonlocal slowest
                with httpx.Client(base_url=base, timeout=60) as health:
                    while not done.is_set():
                        started = time.perf_counter()
                        health.get("/health")
                        slowest = max(slowest, time.perf_counter() - started)
                        time.sleep(0.02)

            poller = threading.Thread(target=poll)
            poller.start()
            headers = {"x-api-key": key}
            started = time.perf_counter()
            answers = await asyncio.gather(
                *(http.post("/v1/messages/count_tokens", content=body, headers=headers) for _ in range(calls))
            )
            took = time.perf_counter() - started
            done.set()
            poller.join()
            statuses = Counter(answer.status_code for answer in answers)
            print(
                f"{calls} counts of {len(body) / 2**20:.1f} MiB: statuses {dict(statuses)}, {took:.2f} s; "
                f"server peak {before:.0f} -> {peak_mib(server.pid):.0f} MiB; slowest /health {slowest * 1000:.0f} ms"
            )
    finally:
        server.terminate()
        server.wait(timeout=20)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--mib", type=int, default=6)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.mib))
