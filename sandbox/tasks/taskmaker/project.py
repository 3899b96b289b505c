"""The project a task set is made from: a folder, a git repository or an sdist/archive, copied to a working folder;
its language, its test files, its source files, and what it declares it needs (declared.py)."""

from __future__ import annotations

import configparser
import fnmatch
import re
import shutil
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.tasks.taskmaker.declared import declared

SKIPPED = {".git", ".hg", ".svn", ".venv", "venv", ".tox", ".nox", "__pycache__", ".pytest_cache", "build", "dist",
           "node_modules", ".mypy_cache", ".ruff_cache", ".eggs"}  # fmt: skip
OTHER_LANGUAGES = {
    "package.json": "JavaScript/TypeScript",
    "Cargo.toml": "Rust",
    "go.mod": "Go",
    "pom.xml": "Java",
    "build.gradle": "Java/Kotlin",
    "Gemfile": "Ruby",
    "CMakeLists.txt": "C/C++",
    "composer.json": "PHP",
}
TEST_FILES = ("test_*.py", "*_test.py", "conftest.py")
NOT_SOURCE = ("setup.py", "noxfile.py", "fabfile.py", "tasks.py", "conftest.py")
NOT_SOURCE_DIRS = {"tests", "test", "testing", "docs", "doc", "examples", "example", "benchmarks", "scripts"}
ARCHIVES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar", ".zip")


class SourceError(ValueError):
    """A source tasks cannot be made from; the message says why, in one line."""


@dataclass(frozen=True, slots=True)
class Project:
    root: Path  # the working copy
    name: str
    test_files: tuple[str, ...]  # relative paths: the files a task's verifier restores before it runs the tests
    source_files: tuple[str, ...]  # where bugs may be made
    test_requirements: tuple[str, ...]
    installable: bool  # has a pyproject.toml, setup.py or setup.cfg: `pip install -e .`
    dependencies: tuple[str, ...] = ()  # what it declares in its files: installed before any of its code runs
    build_requirements: tuple[str, ...] = ()  # its build backend's: it is installed with no network, no isolation

    @property
    def measured(self) -> tuple[str, ...]:
        """What coverage measures: the source files' top folders, or every file when a module sits at the root."""
        tops = {path.split("/")[0] for path in self.source_files}
        return (".",) if any("/" not in path for path in self.source_files) else tuple(sorted(tops))


def copy_source(source: Path, into: Path) -> Path:
    """The project's files, copied (a folder or repository) or unpacked (an archive) under `into`; its root."""
    if not source.exists():
        raise SourceError(f"{source}: no such file or folder")
    if source.is_dir():
        root = into / "project"
        shutil.copytree(
            source, root, ignore=lambda _dir, names: [n for n in names if n in SKIPPED or n.endswith(".egg-info")]
        )
        return root
    unpacked = into / "unpacked"
    try:
        if source.name.endswith(".zip"):
            with zipfile.ZipFile(source) as archive:
                archive.extractall(unpacked)
        elif source.name.endswith(ARCHIVES):
            with tarfile.open(source) as archive:
                archive.extractall(unpacked, filter="data")
        else:
            raise SourceError(f"{source}: not a repository, a folder or an archive ({', '.join(ARCHIVES)})")
    except (tarfile.TarError, zipfile.BadZipFile, OSError) as e:
        raise SourceError(f"{source}: not an archive that unpacks ({e})") from None
    entries = list(unpacked.iterdir())
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else unpacked


def detect(root: Path, source: Path) -> Project:
    """The Python project at `root`; SourceError for another language, or a project with no tests."""
    python = [p.relative_to(root).as_posix() for p in sorted(root.rglob("*.py")) if not SKIPPED & set(p.parts)]
    markers = [name for name in ("pyproject.toml", "setup.py", "setup.cfg") if (root / name).is_file()]
    if not python:
        other = next((lang for marker, lang in OTHER_LANGUAGES.items() if (root / marker).is_file()), None)
        if other:
            raise SourceError(
                f"{source}: a {other} project; `tasks make` supports Python projects (pytest or unittest)"
            )
        raise SourceError(f"{source}: no Python project here (no .py files)")
    tests = tuple(path for path in python if _is_test(path))
    if not any(not path.endswith("conftest.py") for path in tests):
        raise SourceError(f"{source}: no tests found (no test_*.py or *_test.py files)")
    sources = tuple(path for path in python if path not in tests and _is_source(path))
    if not sources:
        raise SourceError(f"{source}: no source files outside the tests to make bugs in")
    config = _toml(root / "pyproject.toml")
    needs = declared(root, config, bool(markers))
    name = _name(root, config, needs.name)
    return Project(root, name, tests, sources, needs.test, bool(markers), needs.dependencies, needs.build)


def _is_test(path: str) -> bool:
    parts = path.split("/")
    return any(fnmatch.fnmatch(parts[-1], pattern) for pattern in TEST_FILES) or bool(
        {"tests", "test"} & set(parts[:-1])
    )


def _is_source(path: str) -> bool:
    parts = path.split("/")
    return parts[-1] not in NOT_SOURCE and not NOT_SOURCE_DIRS & set(parts[:-1]) and not parts[-1].startswith(".")


def _toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except tomllib.TOMLDecodeError:
        return {}


def _name(root: Path, config: dict[str, Any], declared_name: str | None) -> str:
    name = config.get("project", {}).get("name") or declared_name
    if not name and (root / "setup.cfg").is_file():
        parser = configparser.ConfigParser(interpolation=None)
        parser.read(root / "setup.cfg", encoding="utf-8")
        name = parser.get("metadata", "name", fallback=None)
    return re.sub(r"[^a-z0-9]+", "-", str(name or root.name).lower()).strip("-") or "project"
