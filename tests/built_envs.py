"""The `venvs` mark: the tests that run an environment .ci/run builds (the vLLM venv, a trainer venv, a model).

Those are every test that uses the session's vLLM (the `vllm` fixture, directly or through another) and every test of
a file that calls a builder itself (`vllm_python`, `build_tiny_model`, `.ci/trainer-venv` ...). On a new machine the
builds take minutes, so .ci/run runs the other tests (`-m "not venvs"`) while they are under way and these
(`-m venvs`) once they are ready. Nothing to mark by hand: a new test that asks for `vllm` or calls a builder joins
them; one that reached a builder some other way would fail on a new machine (its build outlasting the test's
timeout), never be skipped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

MARK = "venvs"
BUILDERS = re.compile(r"\b(vllm_python|build_tiny_model|build_smollm2|vllm_server|trainer-venv)\b|\.ci/vllm\b")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARK}: runs an environment .ci/run builds (set by tests/built_envs.py)")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by it
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    calls_a_builder: dict[Path, bool] = {}
    for item in items:
        if item.path not in calls_a_builder:
            calls_a_builder[item.path] = bool(BUILDERS.search(item.path.read_text()))
        if calls_a_builder[item.path] or "vllm" in getattr(item, "fixturenames", ()):
            item.add_marker(MARK)
