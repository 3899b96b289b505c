"""What a project says it needs, read from its files without running any of its code: its dependencies and build
requirements, installed with the network before anything of the project's runs, and what its tests need."""

from __future__ import annotations

import ast
import configparser
import email.parser
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEST_EXTRAS = ("test", "tests", "testing", "dev")
REQUIREMENT_FILES = ("requirements-test*.txt", "requirements_test*.txt", "test-requirements*.txt",
                     "test_requirements*.txt", "requirements/test*.txt", "tests/requirements*.txt")  # fmt: skip
LEGACY_BUILD = ("setuptools>=40.8.0", "wheel")  # what pip builds a project with no [build-system] with
# A requirement on the index: a name, extras, versions, a marker. Not a direct reference (`name @ URL`: whatever that
# URL serves), not an option (`-r`, `--index-url`), not a path.
_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\s*(\[[\w\s,.-]*\])?\s*[\w\s<>=!~*.,+()-]*(;[^@]*)?$")
_EXTRA_ONLY = re.compile(r"""^(.*?)\s*;\s*extra\s*==\s*["']([\w.-]+)["']\s*$""")


@dataclass(frozen=True, slots=True)
class Declared:
    dependencies: tuple[str, ...]
    build: tuple[str, ...]  # its build backend's requirements: the project is installed with no build isolation
    test: tuple[str, ...]
    name: str | None = None  # setup.py's literal `name=`, for a project that declares it nowhere else


def declared(root: Path, config: dict[str, Any], installable: bool) -> Declared:
    """`config`: the project's pyproject.toml, parsed."""
    cfg = _ini(root, "setup.cfg", "tox.ini")
    setup_py = _setup_py(root / "setup.py")
    dependencies, test = _metadata(root)
    project = config.get("project", {})
    if "dependencies" not in project.get("dynamic", []):
        dependencies += _strings(project.get("dependencies", []))
    dependencies += cfg.get("options", "install_requires", fallback="").splitlines()
    dependencies += _strings(setup_py.get("install_requires", []))
    dependencies += _lines(root / "requirements.txt")  # what `install_requires=open(...)` reads, most often
    system = config.get("build-system", {})
    build = _strings(system.get("requires", [])) if "requires" in system else list(LEGACY_BUILD if installable else [])
    extras, groups = project.get("optional-dependencies", {}), config.get("dependency-groups", {})
    setup_extras = setup_py.get("extras_require", {}) if isinstance(setup_py.get("extras_require"), dict) else {}
    for key in TEST_EXTRAS:
        test += _strings(extras.get(key, [])) + _strings(groups.get(key, []))  # an include-group is a table
        test += cfg.get("options.extras_require", key, fallback="").splitlines() + _strings(setup_extras.get(key, []))
    test += _strings(setup_py.get("tests_require", [])) + cfg.get("testenv", "deps", fallback="").splitlines()
    for pattern in REQUIREMENT_FILES:
        for path in sorted(root.glob(pattern)):
            test += _lines(path)
    name = setup_py.get("name")
    return Declared(_kept(dependencies), _kept(build), _kept(test), name if isinstance(name, str) else None)


def _kept(found: list[str]) -> tuple[str, ...]:
    kept: list[str] = []
    for line in found:
        requirement = line.split("#")[0].strip()
        factored = re.match(r"^[\w.,!-]+:\s", requirement)  # tox's `factor: dep`, for one environment only
        if _REQUIREMENT.match(requirement) and not factored and requirement not in kept:
            kept.append(requirement)
    return tuple(kept)


def _strings(value: Any) -> list[str]:
    return [item for item in value if isinstance(item, str)] if isinstance(value, list | tuple) else []


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8", errors="replace").splitlines() if path.is_file() else []


def _ini(root: Path, *names: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    for name in names:
        if (root / name).is_file():
            try:
                parser.read(root / name, encoding="utf-8")
            except configparser.Error:
                continue
    return parser


def _setup_py(path: Path) -> dict[str, Any]:
    """The literal keywords of setup.py's `setup(...)` call, a name bound to a literal at module level followed:
    what it declares without being run."""
    try:
        tree = ast.parse(path.read_bytes()) if path.is_file() else ast.Module(body=[], type_ignores=[])
    except (SyntaxError, ValueError):
        return {}
    bound = {
        target.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "setup":
            for keyword in node.keywords:
                value = bound.get(keyword.value.id, keyword.value) if isinstance(keyword.value, ast.Name) else None
                try:
                    found[str(keyword.arg)] = ast.literal_eval(value or keyword.value)
                except (ValueError, TypeError, SyntaxError, RecursionError):
                    continue
    return found


def _metadata(root: Path) -> tuple[list[str], list[str]]:
    """An sdist's own record of what it requires (PKG-INFO, *.egg-info/requires.txt): dependencies, test extras."""
    dependencies: list[str] = []
    test: list[str] = []
    if (root / "PKG-INFO").is_file():
        headers = email.parser.BytesParser().parsebytes((root / "PKG-INFO").read_bytes(), headersonly=True)
        for requirement in headers.get_all("Requires-Dist") or []:
            extra = _EXTRA_ONLY.match(requirement)
            if extra is None and "extra" not in requirement.partition(";")[2]:
                dependencies.append(requirement)
            elif extra is not None and extra.group(2) in TEST_EXTRAS:
                test.append(extra.group(1))
    for requires in sorted(root.glob("*.egg-info/requires.txt")):
        section = ""
        for line in _lines(requires):
            if line.startswith("["):
                section = line.strip("[] ")
            elif not section:
                dependencies.append(line)
            elif section.startswith(":"):
                dependencies.append(f"{line}; {section[1:]}")
            elif section in TEST_EXTRAS:
                test.append(line)
    return dependencies, test
