"""examples/rl/grpo.py on a clean clone: without the project's .venv (trajproxy and the agent's `openai` SDK) it says
in one line what to run, before it starts anything; and by default it plots beside the user, never over the
training page's figure (docs/rl-reward.png, tracked)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from testkit.tasks import ROOT
from testkit.vllm_server import vllm_python


@pytest.fixture(scope="module")
def python() -> str:
    return vllm_python()  # torch and transformers, as the example's docstring runs it


def clean_clone(tmp_path: Path) -> Path:
    """The example and what it imports from the checkout, where no .venv was made."""
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "examples" / "rl", clone / "examples" / "rl")
    (clone / "testkit").mkdir()
    shutil.copy(ROOT / "testkit" / "vllm_server.py", clone / "testkit")
    shutil.copytree(ROOT / "integrations", clone / "integrations")  # the vLLM server and the weights' recipe
    return clone


@pytest.mark.timeout(300)
def test_without_the_projects_venv_it_says_what_to_run_in_one_line(python: str, tmp_path: Path) -> None:
    clone = clean_clone(tmp_path)
    done = subprocess.run(
        [python, str(clone / "examples" / "rl" / "grpo.py"), "--steps", "1", "--work-dir", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=240,  # imports only: it stops before it starts vLLM (which took 76 s, then a traceback)
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert "starting vLLM" not in done.stdout and "Traceback" not in done.stderr, done.stderr
    said = done.stderr.strip().splitlines()[-1]
    assert ".venv" in said and "pip install -e ." in said and "--trajproxy-url" in said, said


@pytest.mark.timeout(300)
def test_its_plot_goes_beside_the_user_not_over_the_readmes_figure(python: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [python, str(ROOT / "examples" / "rl" / "grpo.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "400"},  # argparse's help on one line: it breaks words at hyphens
    )
    assert done.returncode == 0, done.stderr
    found = re.search(r"^\s+--plot PLOT\s+(.*?)^\s+--", done.stdout, re.S | re.M)
    assert found, done.stdout
    said = " ".join(found[1].split())
    assert said.startswith("where to plot the mean reward per step (default: grpo-reward.png in the working"), said
