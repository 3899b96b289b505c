"""The hexagon, checked from the source: what the core may import, where each outside library lives."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import proxy

PACKAGE = Path(proxy.__file__).parent
ROOT = PACKAGE.parent

CORE_MAY_NOT_IMPORT = {
    "fastapi",
    "starlette",
    "sqlmodel",
    "sqlalchemy",
    "litellm",
    "tiktoken",
    "docker",
    "httpx",
    "uvicorn",
    "granian",
    "pydantic",
    "pydantic_settings",
}

# library -> the modules (a folder ends in "/") allowed to import it
HOMES = {
    "fastapi": ("proxy/http/", "proxy/app.py"),
    "starlette": ("proxy/http/", "proxy/app.py"),
    "sqlmodel": ("proxy/storage/",),
    "sqlalchemy": ("proxy/storage/",),
    "tiktoken": ("proxy/adapters/tiktoken_counter.py",),
    "uvicorn": ("proxy/servers/uvicorn_front.py",),  # each HTTP server in one adapter, behind servers.front.Front
    "granian": ("proxy/servers/granian_front.py",),
    "docker": (),  # containers are the sandbox's business, never the proxy's
}


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name
    line: int
    top_level: bool  # runs when the importing module is imported, not only when a function is called

    @property
    def root(self) -> str:
        return self.module.split(".")[0]


def imports_in(source: str, package: str) -> list[Import]:
    """Every import statement in `source`, relative ones resolved against `package`."""
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(alias.name, child.lineno, not in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.append(Import(absolute(child, package), child.lineno, not in_function))
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(ast.parse(source), in_function=False)
    return found


def absolute(node: ast.ImportFrom, package: str) -> str:
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def name_of(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def package_of(path: Path) -> str:
    """The package a module's relative imports resolve against: the folder it is in (for __init__.py too)."""
    return ".".join(path.relative_to(ROOT).parent.parts)


def imports_of(path: Path) -> list[Import]:
    return imports_in(path.read_text(encoding="utf-8"), package_of(path))


def allowed(module: str, homes: tuple[str, ...]) -> bool:
    return any(module.startswith(home) if home.endswith("/") else module == home for home in homes)


# The checker itself


def test_the_scanner_sees_imports_at_every_depth() -> None:
    source = (
        "import os.path\n"
        "from fastapi import FastAPI\n"
        "from . import values\n"
        "from ..storage.sql import SqlStore\n"
        "try:\n    import docker\nexcept ImportError:\n    pass\n"
        "class A:\n    import httpx\n"
        "def f():\n    import litellm\n    def g():\n        from tiktoken import get_encoding\n"
        "async def h():\n    import uvicorn\n"
    )
    seen = {(i.module, i.top_level) for i in imports_in(source, "proxy.core")}
    assert seen == {
        ("os.path", True),
        ("fastapi", True),
        ("proxy.core", True),
        ("proxy.storage.sql", True),
        ("docker", True),
        ("httpx", True),
        ("litellm", False),
        ("tiktoken", False),
        ("uvicorn", False),
    }


def test_the_scan_covers_the_package() -> None:
    names = {name_of(path) for path in modules()}
    assert {
        "proxy/app.py",
        "proxy/core/ports.py",
        "proxy/storage/sql.py",
        "proxy/adapters/tiktoken_counter.py",
    } <= names
    assert any(i.root == "fastapi" for i in imports_of(PACKAGE / "app.py"))
    assert any(i.root == "sqlalchemy" for i in imports_of(PACKAGE / "storage" / "sql.py"))


# The rules


@pytest.mark.parametrize("path", [p for p in modules() if "core" in p.relative_to(PACKAGE).parts], ids=name_of)
def test_the_core_imports_no_framework_orm_or_sdk(path: Path) -> None:
    bad = [f"line {i.line}: {i.module}" for i in imports_of(path) if i.root in CORE_MAY_NOT_IMPORT]
    assert bad == [], f"{name_of(path)} is in the core and may not import these"


@pytest.mark.parametrize("path", [p for p in modules() if "core" in p.relative_to(PACKAGE).parts], ids=name_of)
def test_the_core_imports_nothing_from_outside_the_core(path: Path) -> None:
    bad = [
        f"line {i.line}: {i.module}"
        for i in imports_of(path)
        if i.root == "proxy" and i.module != "proxy" and not i.module.startswith("proxy.core")
    ]
    assert bad == [], f"{name_of(path)} is in the core; adapters depend on it, not the other way round"


@pytest.mark.parametrize("library", sorted(HOMES))
def test_each_outside_library_is_imported_only_in_its_adapter(library: str) -> None:
    homes = HOMES[library]
    bad = [
        f"{name_of(path)}:{i.line}: {i.module}"
        for path in modules()
        for i in imports_of(path)
        if i.root == library and not allowed(name_of(path), homes)
    ]
    assert bad == [], f"{library} may only be imported in {homes or 'no module under proxy/'}"


def test_litellm_is_never_imported_at_module_top_level() -> None:
    bad = [
        f"{name_of(path)}:{i.line}: {i.module}"
        for path in modules()
        for i in imports_of(path)
        if i.root == "litellm" and i.top_level
    ]
    assert bad == [], "litellm costs seconds to import; import it inside the function that needs it"


@pytest.mark.parametrize("path", modules(), ids=name_of)
def test_every_module_opens_with_a_docstring(path: Path) -> None:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    assert docstring, f"{name_of(path)} does not open with a docstring"
    assert docstring.splitlines()[0].strip(), f"{name_of(path)}'s docstring does not start with a summary line"


def test_the_proxy_never_imports_the_sandbox() -> None:
    """The arrows run one way: sandbox uses proxy (the embedded proxy, the client); proxy reaches sandbox's
    commands only through the `trajproxy.commands` entry points."""
    bad = [
        f"{name_of(path)}:{i.line}: {i.module}" for path in modules() for i in imports_of(path) if i.root == "sandbox"
    ]
    assert bad == [], "proxy may not import sandbox"


def test_the_sandbox_commands_reach_the_command_line_through_the_entry_point() -> None:
    from importlib.metadata import entry_points

    from proxy.cli.main import PLUGINS, _parser

    assert [plugin.value for plugin in entry_points(group=PLUGINS)] == ["sandbox.launch:add_commands"]
    parsed = _parser().parse_args(["sandbox", "prune"])
    assert parsed.handler.__module__ == "sandbox.launch"
