"""`trajproxy agents`: `list` says what each agent runs on (a carried Python or Node, or native: its own binary),
for presets, for the manifest files it is given (and only those) and for bundles built from a user's own manifest;
`build --help` is build's own help; `install.python = true` is documented."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from testkit.tasks import ROOT
from tests.test_launch import TRAJPROXY

MANIFEST = """name = "my-agent"
version = "1.0.0"
command = "{bundle}/bin/python3 -c 'print(1)'"

[install]
python = true
"""


def agents(*args: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "COLUMNS": "200"}  # the table in full, as a wide terminal shows it
    return subprocess.run([TRAJPROXY, "agents", *args], capture_output=True, text=True, timeout=600, env=environment)


def rows(said: str) -> dict[str, list[str]]:
    """The table's rows by agent: its cells."""
    found = {}
    for line in said.splitlines():
        if line.count("│") > 2:
            cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
            found[cells[0]] = cells
    return found


def test_list_says_what_each_preset_runs_on(tmp_path: Path) -> None:
    listed = agents("list", "--bundles", str(tmp_path / "none"))
    assert listed.returncode == 0, listed.stderr
    runs_on = {name: cells[2] for name, cells in rows(listed.stderr).items()}
    assert runs_on["minimal"] == "Python 3.11" and runs_on["gemini-cli"] == "Node 22"
    assert runs_on["codex"] == runs_on["claude-code"] == "native", runs_on  # their own binaries, from npm
    assert "" not in runs_on.values(), runs_on


def test_list_of_a_manifest_file_lists_that_file(tmp_path: Path) -> None:
    manifest = tmp_path / "my-agent.toml"
    manifest.write_text(MANIFEST)
    listed = agents("list", str(manifest), "--bundles", str(tmp_path / "none"))
    assert listed.returncode == 0, listed.stderr
    assert {name: cells[1:4] for name, cells in rows(listed.stderr).items()} == {
        "my-agent": ["1.0.0", "Python 3.11", "not built"]  # python = true: the first Python a bundle carries
    }
    missing = agents("list", str(tmp_path / "nowhere.toml"))
    assert missing.returncode == 1 and missing.stderr.strip().splitlines() == [
        f"trajproxy agents list: no manifest file {tmp_path / 'nowhere.toml'}"
    ]


@pytest.mark.timeout(600)
def test_a_users_own_bundle_says_what_it_runs_on(tmp_path: Path, engine: Any) -> None:
    manifest = tmp_path / "my-agent.toml"
    manifest.write_text(MANIFEST)
    bundles = str(tmp_path / "bundles")
    built = agents("build", str(manifest), "--bundles", bundles)
    assert built.returncode == 0, built.stderr
    listed = agents("list", "--bundles", bundles)  # the presets, then the bundles of no preset
    cells = rows(listed.stderr)["my-agent"]
    assert cells[2] == "Python 3.11" and cells[3] != "not built", cells


def test_build_has_its_own_help() -> None:
    helped = agents("build", "--help")
    assert helped.returncode == 0
    said = " ".join(helped.stdout.split())
    assert said.startswith("usage: trajproxy agents build"), said
    assert "--force" in said and "{build,list}" not in said
    listing = " ".join(agents("list", "--help").stdout.split())
    assert listing.startswith("usage: trajproxy agents list") and "--force" not in listing, listing


def test_install_python_true_is_documented() -> None:
    page = (ROOT / "docs" / "agents.md").read_text()  # "Writing a manifest"
    block = re.search(r"```toml\nname = \"my-agent\".*?```", page, re.S)
    assert block and re.search(r"^python = .*# .*\btrue\b.*3\.11", block[0], re.M), "install.python = true"
