"""The house, checked from the source: what the core may import, where each outside library lives, no import
circles, no arrow running back up from a lower layer, and no import inside a function but a marked lazy load."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
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
    "transformers",
    "mistral_common",
    "openai_harmony",
}

# library -> the modules (a folder ends in "/") allowed to import it
HOMES = {
    "fastapi": ("proxy/http/", "proxy/app.py"),
    "starlette": ("proxy/http/", "proxy/app.py"),
    "sqlmodel": ("proxy/storage/",),
    "sqlalchemy": ("proxy/storage/",),
    "tiktoken": ("proxy/adapters/tiktoken_counter.py",),
    "transformers": ("proxy/adapters/chat_templates.py",),
    "mistral_common": ("proxy/adapters/mistral_template.py",),
    "openai_harmony": ("proxy/adapters/harmony_template.py",),
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


def parse(source: str) -> ast.Module:
    """ast.parse, robust to CPython 3.11's AST constructor keeping its recursion count per interpreter, not per
    thread: another thread's work interleaved with a parse can make it raise a spurious "AST constructor recursion
    depth mismatch" (python/cpython#106905). Each parse starts its count afresh, so a second one is sound."""
    try:
        return ast.parse(source)
    except SystemError as e:
        if "recursion depth mismatch" not in str(e):
            raise
        return ast.parse(source)


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

    visit(parse(source), in_function=False)
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
    assert any(i.root == "starlette" for i in imports_of(PACKAGE / "app.py"))
    assert any(i.root == "fastapi" for i in imports_of(PACKAGE / "http" / "docs.py"))
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
    docstring = ast.get_docstring(parse(path.read_text(encoding="utf-8")))
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

    assert sorted(plugin.value for plugin in entry_points(group=PLUGINS)) == [
        "integrations.launch:add_commands",
        "sandbox.launch:add_commands",
    ]
    assert _parser().parse_args(["sandbox", "prune"]).handler == "sandbox.commands:main"
    parsed = _parser().parse_args(["train", "tasks.jsonl", "--agent", "minimal", "--model", "m"])
    assert parsed.handler == "integrations.train.command:main"


# The house: one-way arrows between layers, no circles, lazy loads only where marked

# Lowest first: a module may import from its own layer or one below it, never from one above. A folder ends in "/".
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("the domain and the model families' entries", ("proxy/__init__.py", "proxy/core/", "proxy/families/")),
    ("the trainer API's schema and the settings", ("proxy/schema/", "proxy/settings.py", "proxy/trainer_token.py")),
    (
        "adapters: the agents' dialects, storage, the libraries behind the ports, the client",
        ("proxy/dialects/", "proxy/storage/", "proxy/adapters/", "proxy/client/"),
    ),
    ("the web: the route table, the agent and trainer routes, the page", ("proxy/http/",)),
    ("the app: everything wired together", ("proxy/app.py",)),
    ("servers and commands", ("proxy/servers/", "proxy/cli/")),
    ("the sandbox's package and how its commands speak", ("sandbox/__init__.py", "sandbox/console.py")),
    ("the sandbox's backends: where sandboxes start (Docker, Ray), and which run made them", ("sandbox/backends/",)),
    ("tasks: their formats, their grading, and making them (`tasks make`)", ("sandbox/tasks/",)),
    ("agents: manifests, bundles, injection into a task's image", ("sandbox/agents/",)),
    ("runs: the runner, its policies, where it meets trajproxy, its report", ("sandbox/run/",)),
    ("the sandbox's commands: their options and what runs them", ("sandbox/launch.py", "sandbox/commands.py")),
    ("the trainers' adapters and trajproxy train", ("integrations/",)),
    (
        "the kit the tests and the benchmarks share: the tiny model's vLLM, the example task, scripted agents",
        ("testkit/",),
    ),
]
SCANNED = (ROOT / "proxy", ROOT / "sandbox", ROOT / "integrations", ROOT / "testkit", ROOT / "benchmarks")
LAZY = re.compile(r"#.*\blazy:")


@dataclass(frozen=True)
class Edge:
    source: str  # the importing module's path, relative to the repository
    target: str  # the imported module's path
    line: int
    top_level: bool


def house_modules() -> dict[str, Path]:
    """Every module of ours by dotted name: proxy.* and sandbox.* as packages, benchmarks/* as the scripts they
    are (each run with its folder on the path)."""
    found: dict[str, Path] = {}
    for root in SCANNED:
        for path in sorted(root.rglob("*.py")):
            if "presets" in path.relative_to(ROOT).parts:  # agents' own code, reached through a link
                continue
            parts = path.relative_to(root.parent if root.name != "benchmarks" else root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def edges(modules: dict[str, Path]) -> Iterator[Edge]:
    """Each import of one of our modules by another, a `from package import module` resolved to the module."""
    for name, path in modules.items():
        yield from edges_of(name, path, modules)


def edges_of(name: str, path: Path, modules: dict[str, Path]) -> Iterator[Edge]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST, in_function: bool) -> Iterator[Edge]:
        for child in ast.iter_child_nodes(node):
            targets: list[str] = []
            line = getattr(child, "lineno", 0)
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = absolute(child, package)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in child.names
                ]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    yield Edge(name_of(path), name_of(modules[target]), line, not in_function)
            yield from visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    yield from visit(parse(path.read_text(encoding="utf-8")), in_function=False)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None and child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child is not None:
                if child in stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while (member := stack.pop()) != node:
                        group.append(member)
                    group.append(node)
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def layer_of(module: str) -> int | None:
    for rank, (_, homes) in enumerate(LAYERS):
        if allowed(module, homes):
            return rank
    return None


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    graph: dict[str, set[str]] = {}
    for edge in edges(house_modules()):
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    assert circles(graph) == [], "these modules import each other, directly or round a circle"


def test_every_module_has_a_layer() -> None:
    unplaced = [name_of(path) for path in house_modules().values() if "benchmarks" not in path.parts]
    assert [module for module in unplaced if layer_of(module) is None] == [], "add them to LAYERS"


def test_no_arrow_runs_back_up_from_a_lower_layer() -> None:
    bad = [
        f"{edge.source}:{edge.line} imports {edge.target} ({LAYERS[up][0]})"
        for edge in edges(house_modules())
        if (down := layer_of(edge.source)) is not None and (up := layer_of(edge.target)) is not None and up > down
    ]
    assert bad == [], "a module may import only from its own layer or the ones below it"


def test_no_benchmark_or_kit_imports_a_test_module() -> None:
    """A test module is no library: what the benchmarks share with the tests lives in testkit/, which both import."""
    found = [
        f"{name_of(path)}:{i.line}: {i.module}"
        for root in (ROOT / "benchmarks", ROOT / "testkit", ROOT / "examples")
        for path in sorted(root.rglob("*.py"))
        for i in imports_of(path)
        if i.root == "tests"
    ]
    assert found == [], "import it from testkit/ (move it there if a test module holds it)"


def test_imports_inside_functions_are_marked_lazy_loads_of_outside_libraries() -> None:
    """An import inside a function is a deliberate lazy load of a heavy or optional library, marked `# lazy: why`
    on its line or on the line above its group of imports; never one of our own modules (that hides a circle)."""
    ours = house_modules()
    bad: list[str] = []
    for path in ours.values():
        lines = path.read_text(encoding="utf-8").splitlines()
        package = ".".join(path.relative_to(ROOT).parent.parts)
        for found in imports_in("\n".join(lines), package):
            if found.top_level:
                continue
            where = f"{name_of(path)}:{found.line}: {found.module}"
            if found.module.split(".")[0] in {"proxy", "sandbox"} or found.module in ours:
                bad.append(f"{where} (one of ours: import it at the top)")
            elif not marked_lazy(lines, found.line):
                bad.append(f"{where} (mark it '# lazy: <why>', or import it at the top)")
    assert bad == [], "imports inside functions"


def marked_lazy(lines: list[str], line: int) -> bool:
    """Whether the import on `line` (1-based), or the comment above the run of imports it is in, says lazy."""
    i = line - 1
    while i >= 0 and (LAZY.search(lines[i]) is None):
        text = lines[i].strip()
        if i != line - 1 and not text.startswith(("import ", "from ")):
            return False
        i -= 1
    return i >= 0


def test_the_architecture_doc_names_only_files_that_exist() -> None:
    """docs/architecture.md walks a newcomer through the code: every file it names is where it says."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:proxy|sandbox|tests|testkit|agents)/[\w/]+\.(?:py|toml))`", text))
    assert len(named) >= 20
    assert sorted(path for path in named if not (ROOT / path).exists()) == []
