"""trajproxy as a user installs it (`pip install .`, not editable) and points it at a trajproxy of their own: the
presets ship in the package, and `--socket-source` is checked before any sandbox starts.

The installed package's dependencies are the test environment's (a .pth file lists its site-packages, whose
editable finder for trajproxy is never run): only trajproxy itself is installed, from a wheel built here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from sandbox.agents.manifests import presets
from testkit.tasks import EXAMPLE, ROOT

SCRIPT = f"scripted:{EXAMPLE / 'solve.script.jsonl'}"


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/trajproxy.db"  # what is tested here is the same on either database


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with trajproxy installed from a wheel; its `trajproxy` command."""
    where = tmp_path_factory.mktemp("installed")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where / "venv")], check=True)
    wheel = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(where / "wheel"), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert wheel.returncode == 0, wheel.stderr
    python = where / "venv" / "bin" / "python"
    [built] = (where / "wheel").glob("trajproxy-*.whl")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(built)]
    subprocess.run(pip, check=True, capture_output=True, timeout=300)
    site_packages = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(site_packages) / "test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    found = subprocess.run(
        [str(python), "-c", "import sandbox.agents.manifests as m; print(m.__file__)"],
        capture_output=True, text=True, cwd=where, check=True,
    ).stdout  # fmt: skip
    assert found.startswith(site_packages), found  # the installed copy, not the source tree
    return where / "venv" / "bin" / "trajproxy"


def trajproxy(command: Path, *args: str, cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "COLUMNS": "200"}  # the tables in full, as a wide terminal shows them
    return subprocess.run(
        [str(command), *args], capture_output=True, text=True, cwd=cwd, timeout=timeout_s, env=environment
    )


@pytest.mark.timeout(900)
def test_an_installed_trajproxy_lists_every_preset_and_runs_the_minimal_agent(
    installed: Path, tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    listed = trajproxy(installed, "agents", "list", "--bundles", str(tmp_path / "none"), cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split("│")[1].strip(): line for line in listed.stderr.splitlines() if line.count("│") > 2}
    assert set(presets()) <= set(rows), listed.stderr
    assert all("not built" in rows[name] for name in presets())
    done = trajproxy(
        installed, "run", str(EXAMPLE / "tasks.jsonl"), "--agent", "minimal", "--policy", SCRIPT, "--port", "0",
        "--database-url", f"sqlite:///{tmp_path}/run.db", "--label", label, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "1 task(s) run, 0 rejected, mean reward 1.000" in done.stderr
    listed = trajproxy(installed, "agents", "list", cwd=tmp_path)
    minimal = next(line for line in listed.stderr.splitlines() if line.startswith("│ minimal "))  # the preset's row
    assert "not built" not in minimal and "Python 3.11" in minimal, listed.stderr
    assert not engine.containers.list(all=True, filters={"label": label})


def run_against(server: Any, source: str, tmp_path: Path, label: str, timeout_s: float = 300) -> Any:
    command = [
        str(Path(sys.executable).parent / "trajproxy"), "run", str(EXAMPLE / "tasks.jsonl"), "--agent", "minimal",
        "--policy", SCRIPT, "--proxy-url", server.url, "--trainer-token", server.token, "--socket-source", source,
        "--label", label, "--results", str(tmp_path / f"results-{Path(source).name}.jsonl"),
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)


@pytest.mark.timeout(600)
def test_socket_source_takes_the_sockets_path_and_refuses_a_missing_one_before_any_sandbox(
    make_server: Any, socket_dir: str, tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    """A socket of any name, by its path; a missing one, or a folder without proxy.sock, is refused in one line
    before anything starts; a socket nobody listens on any more (trajproxy gone) fails the episode saying so."""
    server = make_server(socket_path=f"{socket_dir}/agents.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(f"{socket_dir}/stale.sock")
    stale.close()  # its file stays: a trajproxy that died without removing it
    for given, said in [
        (f"{socket_dir}/nothing.sock", "nothing.sock: not a socket (sockets there: agents.sock, stale.sock); give"),
        (socket_dir, f"{socket_dir}: no socket proxy.sock in that folder (sockets there: agents.sock, stale.sock)"),
        ("no-such-trajproxy-volume", "no Docker volume of that name"),
    ]:
        refused = run_against(server, given, tmp_path, label, timeout_s=60)
        assert refused.returncode == 2, refused.stderr
        assert said in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert not engine.containers.list(all=True, filters={"label": label})

    done = run_against(server, f"{socket_dir}/agents.sock", tmp_path, label)
    assert done.returncode == 0, done.stderr
    assert "1 task(s) run, 0 rejected, mean reward 1.000" in done.stderr

    failed = run_against(server, f"{socket_dir}/stale.sock", tmp_path, label)
    said = "trajproxy gate: cannot reach trajproxy at /run/trajproxy/stale.sock: [Errno 111] Connection refused"
    assert said in failed.stderr, failed.stderr  # the run's output
    [result] = [json.loads(line) for line in (tmp_path / "results-stale.sock.jsonl").read_text().splitlines()]
    assert result["status"] == "failed" and result["reason"].endswith(said), result
