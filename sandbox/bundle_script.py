"""The in-container half of a bundle build: run as `python3 -c SOURCE SPEC` in the build image, on /bundle.

Standard library only. It carries what the bundle's programs need from the build image and nothing from the task
image's: the Python runtime (interpreter, standard library, the shared libraries `ldd` names), the PyPI packages,
the glibc and loader of every dynamically linked executable, and a /bin/sh launcher per executable that starts it
through the carried loader (`ld.so --library-path`), so no LD_LIBRARY_PATH or PYTHONHOME leaks into the agent's
children (the task's own python, its tests). `--argv0` makes `sys.executable` the launcher, so an agent that
re-executes itself goes through it again.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

B = Path("/bundle")
LOADER = "ld-linux-x86-64.so.2"
PYTHON = "python3.11"
LAUNCHER = """#!/bin/sh
# {name}, through the bundle's own loader and libraries: independent of the image's libc.
B="${{0%/bin/*}}"
exec "$B/lib/{loader}" --library-path "$B/lib" --argv0 "$0" "$B/{target}"{options} "$@"
"""
# Isolated: the task's PYTHONPATH, PYTHONHOME and working directory (a repository named like one of the agent's
# packages: requests, click, attrs) must never shadow the agent's own packages.
PYTHON_OPTIONS = " -I"


def shared_libraries(path: Path) -> list[Path]:
    """The libraries `ldd` resolves for an ELF file; [] for a static one or for anything else."""
    done = subprocess.run(["ldd", str(path)], capture_output=True, text=True)
    found = []
    for line in done.stdout.splitlines():
        parts = line.split("=>")
        where = (parts[1] if len(parts) == 2 else parts[0]).strip().split(" (")[0].strip()
        if where.startswith("/"):
            found.append(Path(where))
    return found


def carry(libraries: set[Path]) -> None:
    (B / "lib").mkdir(parents=True, exist_ok=True)
    for library in libraries:
        target = B / "lib" / library.name
        if not target.exists():
            shutil.copy2(library.resolve(), target)


def launcher(name: str, target: str, options: str = "") -> None:
    path = B / "bin" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(LAUNCHER.format(name=name, loader=LOADER, target=target, options=options))
    path.chmod(0o755)


def main(spec: dict[str, Any]) -> None:
    libraries: set[Path] = set()
    if spec["python"]:
        (B / "libexec").mkdir(parents=True, exist_ok=True)
        shutil.copy2(f"/usr/bin/{PYTHON}", B / "libexec" / PYTHON)
        skipped = shutil.ignore_patterns("test", "site-packages")
        shutil.copytree(f"/usr/lib/{PYTHON}", B / "lib" / PYTHON, ignore=skipped)
        packages = B / "lib" / "python3" / "dist-packages"  # where Debian's python looks, relative to its prefix
        packages.mkdir(parents=True)
        if spec["pypi"]:
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-input", "--disable-pip-version-check"]
            pip += ["--break-system-packages", "--no-compile", "--target", str(packages), *spec["pypi"]]
            done = subprocess.run(pip, capture_output=True, text=True)
            if done.returncode != 0:
                errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
                print(" ".join(errors[:2]) or done.stderr.strip()[-500:], file=sys.stderr)
                sys.exit(3)
        libraries.update(shared_libraries(B / "libexec" / PYTHON))
        for extension in (B / "lib").rglob("*.so*"):
            libraries.update(p for p in shared_libraries(extension) if not p.is_relative_to(B))
        launcher("python3", f"libexec/{PYTHON}", PYTHON_OPTIONS)
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j0", str(B / "lib")], capture_output=True)
    for name, target in spec["bin"].items():
        needed = shared_libraries(B / target)
        if needed:
            libraries.update(needed)
            launcher(name, target)
        else:  # static: it needs no loader
            link = B / "bin" / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(B / target, link.parent))
    if libraries:
        carry(libraries)
        loader = B / "lib" / LOADER
        if not loader.exists():
            shutil.copy2(Path(f"/lib64/{LOADER}").resolve(), loader)
    subprocess.run(["chmod", "-R", "a+rX", str(B)], check=True)
    subprocess.run(["chown", "-R", spec["owner"], str(B)], check=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
