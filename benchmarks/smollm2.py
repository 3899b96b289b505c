"""SmolLM2-135M-Instruct on the CPU: how long its build takes (examples/models/smollm2.py, from the PyPI package), how
big the folder is, how long vLLM takes to answer once started on it, and how many tokens a second it samples.

    python benchmarks/smollm2.py [--rebuild] [--sequences 8] [--tokens 64] [--rounds 3]

The build is the cached one (`~/.cache/trajproxy/smollm2-<hash>`, as the tests use) unless `--rebuild` builds into a
fresh temporary folder (the wheel downloaded again). vLLM starts with the tests' flags (`SMOLLM2_FLAGS`), then
`--rounds` times samples `--sequences` completions of exactly `--tokens` tokens (`ignore_eos`) of one prompt in one
request (`n`), and once one sequence alone: tokens per second is all sampled tokens over the request's time.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: testkit/vllm_server.py
from testkit.vllm_server import SMOLLM2_FLAGS, build_smollm2, vllm_python, vllm_server

PROMPT = "<|im_start|>user\nWrite a short story about a robot.<|im_end|>\n<|im_start|>assistant\n"


def sample(base_url: str, sequences: int, tokens: int, seed: int) -> float:
    """Sampled tokens per second for one request of `sequences` completions of `tokens` tokens each."""
    body = {
        "model": "smollm2",
        "prompt": PROMPT,
        "n": sequences,
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": seed,
    }
    began = time.perf_counter()
    answer = httpx.post(f"{base_url}/completions", json=body, timeout=600).raise_for_status().json()
    took = time.perf_counter() - began
    sampled = int(answer["usage"]["completion_tokens"])
    assert sampled == sequences * tokens, answer["usage"]
    return sampled / took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rebuild", action="store_true", help="build into a fresh folder, timing it")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    python = vllm_python()
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="smollm2-bench-") as scratch:
        began = time.perf_counter()
        model = build_smollm2(python, Path(scratch) / "model" if args.rebuild else None)
        result["build_s" if args.rebuild else "cached_build_s"] = round(time.perf_counter() - began, 1)
        result["folder_bytes"] = sum(f.stat().st_size for f in model.iterdir())
        began = time.perf_counter()
        with vllm_server(model, python, served_name="smollm2", flags=SMOLLM2_FLAGS, timeout=900) as server:
            result["ready_s"] = round(time.perf_counter() - began, 1)
            sample(server.base_url, 1, 8, seed=0)  # the first request warms the engine up
            rates = [sample(server.base_url, args.sequences, args.tokens, seed) for seed in range(args.rounds)]
            result[f"tokens_per_s_{args.sequences}_sequences"] = [round(rate, 1) for rate in rates]
            result["tokens_per_s_1_sequence"] = round(sample(server.base_url, 1, args.tokens, seed=0), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
