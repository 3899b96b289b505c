"""What a batch reply's body costs to read: the pydantic models (`proxy.schema.ReplyBatch`, what the route and the
schema use) against the hot path's msgspec Structs (`proxy.schema.replies`), from raw bytes to domain replies.

    python benchmarks/replies.py [--items 1,64,1024] [--repeats 200]

In-process and single-threaded: the best of many rounds, which a shared machine disturbs far less than the
end-to-end throughput of `turns.py`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import msgspec
import orjson

from proxy import schema
from proxy.http.turns import reply_from
from proxy.schema import replies

ITEM = {
    "message": {
        "content": "Let me look at the code first.",
        "tool_calls": [{"function": {"name": "bash", "arguments": {"cmd": "cat calc.py"}}}],
    },
    "usage": {"prompt_tokens": 90, "completion_tokens": 8},
    "lease_id": "le_1a2b3c4d5e6f",
}
FAST = msgspec.json.Decoder(replies.ReplyBatch)


def body(items: int) -> bytes:
    return orjson.dumps({"replies": [{"turn_id": f"tu_{n:024x}", **ITEM} for n in range(items)]})


def pydantic_path(raw: bytes) -> list[Any]:
    return [reply_from(item, item.turn_id) for item in schema.ReplyBatch.model_validate_json(raw).replies]


def msgspec_path(raw: bytes) -> list[Any]:
    return [reply_from(item, item.turn_id) for item in FAST.decode(raw).replies]


def best_s(read: Callable[[bytes], list[Any]], raw: bytes, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        read(raw)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--items", default="1,64,1024", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print("items  pydantic µs/item  msgspec µs/item  faster", flush=True)
    for items in (int(n) for n in args.items.split(",")):
        raw = body(items)
        assert pydantic_path(raw) == msgspec_path(raw)
        slow, fast = (best_s(read, raw, args.repeats) / items * 1e6 for read in (pydantic_path, msgspec_path))
        print(f"{items:>5}  {slow:>16.2f}  {fast:>15.2f}  {slow / fast:>5.1f}x", flush=True)


if __name__ == "__main__":
    main()
