"""What reading a served answer costs, against the least a reader can pay: is a reader of our own worth writing?

A served turn's answer holds every prompt id (the server's echo: some 600 KB at 100k tokens), and trajproxy reads it
with aiohttp as the chunks it arrived in (`proxy/adapters/served_upstream.py`'s `_chunks`): the kernel copies it into
uvloop's buffer, uvloop into a new bytes a read, aiohttp's parser into a new bytes a body chunk. The floor here reads
the same answer the least costly way asyncio allows: into one buffer kept from answer to answer (a
`BufferedProtocol`), so the kernel's copy alone. Both make the same request on a kept-alive connection to a plain
socket server in a thread, which answers every request with the same body; each figure is the reading thread's CPU
(`time.thread_time`) per answer, the kinds taking turns, in rounds.

    python benchmarks/answer_read.py [--sizes 100000,300000,600000] [--answers 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import threading
import time
from collections.abc import Awaitable, Callable

import aiohttp
import uvloop

from proxy.adapters.served_upstream import _chunks

_REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-length: 2\r\n\r\n{}"


def answer(size: int) -> bytes:
    """A 200 answer whose body is `size` bytes of ids as a server writes them."""
    ids = b",".join(str(10_000 + i % 40_000).encode() for i in range(size // 6 + 1))
    body = (b"[" + ids)[: size - 1] + b"]"
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def serve(listener: socket.socket, answers: dict[str, bytes]) -> None:
    """Answers each request on each connection with `answers["now"]`, one thread a connection."""
    while True:
        connection, _ = listener.accept()
        threading.Thread(target=_answer, args=(connection, answers), daemon=True).start()


def _answer(connection: socket.socket, answers: dict[str, bytes]) -> None:
    with connection, connection.makefile("rb") as reader:
        while reader.readline():
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            reader.read(length)
            connection.sendall(answers["now"])


class _Floor(asyncio.BufferedProtocol):
    """Reads each answer into the same buffer; done when its `expected` bytes are in."""

    def __init__(self) -> None:
        self.buffer = bytearray(4 << 20)
        self.read = self.expected = 0
        self.done: asyncio.Future[None] | None = None

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buffer)[self.read :]

    def buffer_updated(self, nbytes: int) -> None:
        self.read += nbytes
        if self.read >= self.expected and self.done is not None:
            self.done.set_result(None)


async def run(sizes: list[int], answers_each: int, rounds: int) -> dict[tuple[str, int], list[float]]:
    listener = socket.create_server(("127.0.0.1", 0))
    answers = {"now": b""}
    threading.Thread(target=serve, args=(listener, answers), daemon=True).start()
    port = listener.getsockname()[1]
    loop = asyncio.get_running_loop()
    transport, floor = await loop.create_connection(_Floor, "127.0.0.1", port)
    times: dict[tuple[str, int], list[float]] = {}
    async with aiohttp.ClientSession() as session:

        async def through_aiohttp() -> None:
            async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=b"{}") as response:
                await _chunks(response)

        async def into_one_buffer() -> None:
            floor.read, floor.expected, floor.done = 0, len(answers["now"]), loop.create_future()
            transport.write(_REQUEST)
            await floor.done

        kinds: dict[str, Callable[[], Awaitable[None]]] = {"aiohttp": through_aiohttp, "floor": into_one_buffer}
        for round_ in range(rounds + 1):  # the first round warms up, not counted
            for size in sizes:
                answers["now"] = answer(size)
                for name, read in kinds.items() if round_ % 2 else reversed(kinds.items()):
                    started = time.thread_time()
                    for _ in range(answers_each):
                        await read()
                    if round_:
                        times.setdefault((name, size), []).append((time.thread_time() - started) / answers_each)
    transport.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,300000,600000", help="answer bodies' sizes in bytes")
    parser.add_argument("--answers", type=int, default=300, help="answers read a kind, a size and a round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    times = uvloop.run(run(sizes, args.answers, args.rounds))
    print("| answer body, bytes | aiohttp, ms an answer (median of rounds) | floor, ms | aiohttp over the floor, ms |")
    print("|---:|---:|---:|---:|")
    for size in sizes:
        ours, least = (statistics.median(times[(name, size)]) * 1e3 for name in ("aiohttp", "floor"))
        print(f"| {size:,} | {ours:.3f} | {least:.3f} | {ours - least:.3f} |")
    small, large = sizes[0], sizes[-1]
    slopes = {
        name: (statistics.median(times[(name, large)]) - statistics.median(times[(name, small)])) * 1e3
        for name in ("aiohttp", "floor")
    }
    per = (large - small) / 100_000
    print(f"\nper 100 KB more answer: aiohttp {slopes['aiohttp'] / per:.3f} ms, floor {slopes['floor'] / per:.3f} ms")


if __name__ == "__main__":
    main()
