"""Real projects' source distributions from PyPI, downloaded once a machine (`tasks make`'s tests and benchmark)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SDISTS = Path(os.environ.get("TRAJPROXY_CACHE") or Path.home() / ".cache" / "trajproxy") / "sdists"


def sdist(requirement: str) -> Path:
    """A project's sdist from PyPI, downloaded once into ~/.cache/trajproxy/sdists (or $TRAJPROXY_CACHE/sdists)."""
    folder = SDISTS / requirement
    if not list(folder.glob("*.tar.gz")):
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d"]
        subprocess.run([*command, str(folder), requirement], check=True, timeout=300)
    return sorted(folder.glob("*.tar.gz"))[0]
