"""pip, saying in one line what it printed that is expected here, and showing everything else as pip said it.

    python3 .ci/pip.py PYTHON install -q ...     # runs PYTHON -m pip install -q ...; exits with pip's status

Expected, and counted rather than shown:
- the locations this machine's pip.conf names that do not exist here (a WARNING per package pip looks up);
- the resolver's notes about what a package requires when that package is not this venv's own but is seen through a
  .pth file (.ci/trainer-venv's venvs see the vLLM venv's packages that way): those are the vLLM venv's business, and
  a trainer venv replaces some of them on purpose (transformers, tokenizers, setuptools) or lacks the CUDA builds
  .ci/vllm removes (torchvision, torchaudio, torchcodec, triton).
A note about a package this venv installed itself, and anything else pip says, is shown.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ABSENT_LOCATION = re.compile(r"^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$")
RESOLVER = "ERROR: pip's dependency resolver does not currently take into account all the packages"
CONFLICT = re.compile(
    r"^(?P<package>[A-Za-z0-9._-]+) \S+ requires .*(, which is not installed| which is incompatible)\.$"
)


def own_packages(python: str) -> set[str]:
    """The distributions installed in the venv's own site-packages (not seen through a .pth), by normalised name."""
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return {normalised(path.name.split("-")[0]) for path in Path(site).glob("*.dist-info")}


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sort_out(said: list[str], own: set[str]) -> tuple[list[str], int, int]:
    """What to show of pip's stderr, and how many absent locations and expected resolver notes were left out."""
    shown: list[str] = []
    absent = expected = 0
    kept_notes: list[str] = []
    in_notes = False
    for line in said:
        if ABSENT_LOCATION.match(line):
            absent += 1
            continue
        if line.startswith(RESOLVER):
            in_notes = True
            continue
        conflict = CONFLICT.match(line) if in_notes else None
        if conflict is None:
            in_notes = False
            shown.append(line)
        elif normalised(conflict["package"]) in own:
            kept_notes.append(line)
        else:
            expected += 1
    if kept_notes:
        shown = [RESOLVER + " (these packages are this venv's own):", *kept_notes, *shown]
    return shown, absent, expected


def main(python: str, *args: str) -> int:
    done = subprocess.run([python, "-m", "pip", *args], stderr=subprocess.PIPE, text=True, check=False)
    shown, absent, expected = sort_out(done.stderr.splitlines(), own_packages(python))
    for line in shown:
        print(line, file=sys.stderr)
    left_out = []
    if absent:
        left_out.append(f"{absent} pip.conf locations absent on this machine")
    if expected:
        left_out.append(f"{expected} notes on what the vLLM venv's packages require (its business: see .ci/pip.py)")
    if left_out:
        print(f".ci/pip.py: expected, not shown: {'; '.join(left_out)}", file=sys.stderr)
    return done.returncode


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python3 .ci/pip.py PYTHON PIP-ARGUMENTS...")
    sys.exit(main(*sys.argv[1:]))
