"""The in-container half of a bundle build: run as `python3 -c SOURCE SPEC` in the build image, with the bundle
being built mounted where it will be mounted in every task (spec["mount"], /opt/trajproxy/agent).

Standard library only. It carries what the bundle's programs need from the build image and nothing from the task
image's: the Python runtime (interpreter, standard library, its PyPI packages), the glibc, loader and shared
libraries every dynamically linked executable names. Then it rewrites each such executable to start through the
carried loader (its program interpreter, rewritten in place), a copy of glibc's that looks for libraries in the
bundle's lib folder where it would look in the system's: the programs run directly,
without a wrapper or an environment variable that would leak into the agent's children (the task's own python, its
tests), and `sys.executable` and Node's `process.execPath` are real executables an agent can start again.

The carried Python is isolated by a `._pth` file beside it (the equivalent of `-I` on every start, relaunches
included): the task's PYTHONPATH and working directory (a repository named like one of the agent's packages:
requests, click, attrs) never shadow the agent's own packages.
"""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

LOADER = "ld-linux-x86-64.so.2"
ELF = b"\x7fELF"
PT_INTERP = 3
# Left out of the carried standard library: what no agent imports and would only make the bundle bigger.
SKIPPED = (
    "test",
    "tests",
    "site-packages",
    "dist-packages",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "config-*",
)
SITECUSTOMIZE = "import site, sys\nsite.addsitedir({packages!r})  # its .pth files (isolated mode skips them)\n"
SCRIPT = '#!/bin/sh\nexec {runtime} {target} "$@"\n'


def run(command: list[str], failing: str) -> None:
    """Run a build step; on failure print, as one line, its error and the line that gives the cause (uv's `error:`
    and `cause:`), else the end of its output, and stop."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        error = next((at for at, line in enumerate(lines) if line.lower().startswith("error")), None)
        said = " ".join(lines[error : error + 2]) if error is not None else f"{failing}: {' '.join(lines)[-800:]}"
        print(said, file=sys.stderr)
        sys.exit(3)


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


def elf_files(bundle: Path) -> list[Path]:
    found = []
    for path in bundle.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_size > 64:
            with path.open("rb") as f:
                if f.read(4) == ELF:
                    found.append(path)
    return found


def interpreter_at(path: Path) -> tuple[int, int] | None:
    """Where a 64-bit ELF file names its program interpreter (offset, size in bytes); None if it names none."""
    with path.open("rb") as f:
        header = f.read(64)
        if header[4] != 2 or header[5] != 1:  # not 64-bit little-endian: not an x86-64 program
            return None
        table, size, count = struct.unpack_from("<Q", header, 0x20)[0], *struct.unpack_from("<HH", header, 0x36)
        for number in range(count):
            f.seek(table + number * size)
            kind, _, offset, _, _, length = struct.unpack("<IIQQQQ", f.read(40))
            if kind == PT_INTERP:
                f.seek(offset)
                return (offset, length) if f.read(length).rstrip(b"\0").endswith(LOADER.encode()) else None
    return None


def run_from(path: Path, loader: str, at: tuple[int, int]) -> None:
    """Name `loader` as the program's interpreter, in place (the file's layout does not change)."""
    offset, length = at
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(loader.encode().ljust(length, b"\0"))


def confined_loader(source: Path, target: Path, lib: str) -> None:
    """A copy of glibc's loader that looks for libraries in `lib` where it would look in the system's folders, and
    reads no /etc/ld.so.cache or /etc/ld.so.preload: nothing of the task image's libc is ever mixed in. Each string
    is replaced by one of the same length (the loader holds their lengths)."""
    data = source.read_bytes()
    replacements = {b"/etc/ld.so.cache": b"/dev/null/ldsoca", b"/etc/ld.so.preload": b"/dev/null/preload1"}
    for folder in (b"/lib/x86_64-linux-gnu/", b"/usr/lib/x86_64-linux-gnu/", b"/lib/", b"/usr/lib/"):
        ours = lib.encode() + b"/"
        if len(ours) <= len(folder):
            replacements[folder] = ours[:-1] + b"/" * (len(folder) - len(ours) + 1)
        else:  # a folder that never exists (proc has no such entry) or holds no libraries
            replacements[folder] = (b"/proc/" + b"_" * (len(folder) - 7) + b"/") if len(folder) >= 8 else b"/sys/"
    for old, new in replacements.items():
        if b"\0" + old + b"\0" not in data:
            sys.exit(f"the build image's {LOADER} has no {old.decode()}: its glibc is not one bundles know")
        data = data.replace(b"\0" + old + b"\0", b"\0" + new + b"\0")
    target.write_bytes(data)
    target.chmod(0o755)


def carry_python(bundle: Path, version: str, packages: list[str], uv: str) -> None:
    """The interpreter as bin/pythonX.Y (and bin/python3), its standard library, its packages in site-packages
    (installed by `uv`, for this interpreter, with the image's own certificate store)."""
    binary = Path(shutil.which(f"python{version}") or sys.exit(f"the build image has no python{version}"))
    stdlib = binary.resolve().parent.parent / "lib" / f"python{version}"
    (bundle / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(binary.resolve(), bundle / "bin" / f"python{version}")
    (bundle / "bin" / "python3").symlink_to(f"python{version}")
    home = bundle / "lib" / f"python{version}"
    shutil.copytree(stdlib, home, ignore=shutil.ignore_patterns(*SKIPPED, "__pycache__"))
    site_packages = home / "site-packages"
    site_packages.mkdir()
    for name in ("python3", f"python{version}"):
        paths = [
            f"../lib/python{version}",
            f"../lib/python{version}/lib-dynload",
            f"../lib/python{version}/site-packages",
        ]
        (bundle / "bin" / f"{name}._pth").write_text("\n".join([*paths, "import site", ""]))
    (home / "sitecustomize.py").write_text(SITECUSTOMIZE.format(packages=str(site_packages)))
    if packages:
        install = [uv, "pip", "install", "--quiet", "--system-certs", "--python", str(binary)]
        run([*install, "--target", str(site_packages), *packages], "uv pip install")
        scripts = site_packages / "bin"  # the packages' commands become the bundle's, on its own Python
        for script in sorted(scripts.iterdir()) if scripts.is_dir() else []:
            lines = script.read_bytes().split(b"\n", 1)
            if lines[0].startswith(b"#!") and b"python" in lines[0] and not (bundle / "bin" / script.name).exists():
                (bundle / "bin" / script.name).write_bytes(
                    b"#!" + str(bundle / "bin" / "python3").encode() + b"\n" + lines[-1]
                )
                (bundle / "bin" / script.name).chmod(0o755)
        shutil.rmtree(scripts, ignore_errors=True)


def main(spec: dict[str, Any]) -> None:
    bundle = Path(spec["mount"])
    lib = bundle / "lib"
    loader = lib / "ld"  # short enough to replace the usual /lib64/ld-linux-x86-64.so.2 in place
    if len(str(loader)) > len(f"/lib64/{LOADER}"):
        sys.exit(f"the bundle's mount point {bundle} is too long for its loader's path")
    if spec["python"]:
        carry_python(bundle, spec["python"], spec["pypi"], spec["uv"])
    if spec["node"]:
        (bundle / "bin").mkdir(parents=True, exist_ok=True)
        (bundle / "bin" / "node").symlink_to(os.path.relpath(bundle / spec["node"], bundle / "bin"))
    libraries: set[Path] = set()
    programs = {}
    for path in elf_files(bundle):
        libraries.update(needed for needed in shared_libraries(path) if not needed.is_relative_to(bundle))
        if (at := interpreter_at(path)) is not None:
            programs[path] = at
    if programs or libraries:
        lib.mkdir(parents=True, exist_ok=True)
        for library in libraries:
            if not (lib / library.name).exists():
                shutil.copy2(library.resolve(), lib / library.name)
        confined_loader(Path(f"/lib64/{LOADER}").resolve(), loader, str(lib))
        if not (lib / LOADER).exists():
            (lib / LOADER).symlink_to("ld")  # libc names the loader by its soname
    for path, at in programs.items():
        run_from(path, str(loader), at)
    for name, target in spec["bin"].items():
        link = bundle / "bin" / name
        link.parent.mkdir(parents=True, exist_ok=True)
        with (bundle / target).open("rb") as f:
            head = f.readline(200)
        runtime = "node" if b"node" in head else "python3" if b"python" in head else ""
        if head.startswith(b"#!") and runtime and (bundle / "bin" / runtime).exists():
            link.write_text(SCRIPT.format(runtime=bundle / "bin" / runtime, target=bundle / target))
            link.chmod(0o755)
        else:
            link.symlink_to(os.path.relpath(bundle / target, link.parent))
    if spec["python"]:
        python = str(bundle / "bin" / "python3")
        run([python, "-c", "import encodings, ssl, json, sqlite3"], "the carried Python does not start")
        subprocess.run([python, "-m", "compileall", "-q", "-j0", str(lib)], capture_output=True)
    if spec["node"]:
        run([str(bundle / "bin" / "node"), "-e", "process.exit(0)"], "the carried Node does not start")
    subprocess.run(["chmod", "-R", "a+rX", str(bundle)], check=True)
    subprocess.run(["chown", "-R", spec["owner"], str(bundle)], check=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
