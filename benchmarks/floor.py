"""The floor: benchmarks/floor/main.go, a minimal parking broker in Go (no storage, no auth), built here with the
machine's Go and driven by the same load as trajproxy (`turn_load.measure`), pinned the same way, side by side.

    python benchmarks/turns.py --floor      # each figure next to the floor's, and the ratio
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from harness import HOST, start_pinned
from turn_load import measure, measured

SOURCE = Path(__file__).parent / "floor"


class NoGo(RuntimeError):
    """There is no Go toolchain to build the floor with."""


@functools.cache
def build() -> Path:
    """The floor's binary, built once per process into a temporary folder."""
    go = shutil.which("go")
    if go is None:
        raise NoGo("the floor is built with Go: apt-get install golang-go")
    out = Path(tempfile.mkdtemp(prefix="trajproxy-floor-")) / "floor"
    env = {**os.environ, "GOCACHE": str(out.parent / "cache"), "GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"}
    subprocess.run([go, "build", "-o", str(out), "."], cwd=SOURCE, env=env, check=True, capture_output=True)
    return out


def bench(agents: int, seconds: float, warmup_s: float, port: int, trainer_kind: str = "http") -> dict[str, float]:
    """The floor's figures under the load `turns.bench` puts on trajproxy (an HTTP trainer: the floor has no
    stream)."""
    server = start_pinned([str(build()), "-port", str(port)], f"http://{HOST}:{port}/health")
    # SIGTERM: a Go program keeps SIGINT ignored when started with it ignored (a job run in the background)
    return measured(server, agents, seconds, measure(port, agents, seconds, warmup_s, trainer_kind), signal.SIGTERM)
