"""Agents as data: every preset loads, a user's own manifest file works, and bad ones get a one-line error."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from sandbox.agents.manifests import PLACEHOLDERS, ManifestError, load, presets

VALUES = {name: f"/{name}" for name in PLACEHOLDERS} | {"task": "fix it's bug; rm -rf /", "workdir": "/repo"}


def test_the_four_presets_load_and_fill_every_placeholder() -> None:
    assert set(presets()) >= {"minimal", "codex", "claude-code", "mini-swe-agent"}
    for name in ("minimal", "codex", "claude-code", "mini-swe-agent"):
        rendered = load(name).render(VALUES)
        assert "{" not in rendered.command, name
        assert rendered.command.startswith("/bundle/bin/"), name
        assert all("{" not in value for value in rendered.env.values()), name


def test_every_preset_renders_and_has_its_row_in_the_docs_and_a_run_line_whose_script_exists() -> None:
    root = Path(__file__).parent.parent
    page = (root / "docs" / "agents.md").read_text()  # the agents' page: the preset table, a run line for each
    for name in presets():
        manifest = load(name)
        rendered = manifest.render(VALUES)
        assert "{" not in rendered.command and "/bundle/bin/" in rendered.command, name
        for file in rendered.files:
            if file.path.endswith(".json"):
                json.loads(file.content)  # the braces doubled right, the values in place
        row = re.search(rf"^\| `{re.escape(name)}` \|[^|]+\| ([^|]+) \|", page, re.M)
        assert row, f"docs/agents.md's preset table has no row for {name}"
        assert row[1] == manifest.version, name
        line = re.search(
            rf"^trajproxy run \S+ --image \S+ --agent {re.escape(name)} --policy scripted:(\S+)$", page, re.M
        )
        assert line and (root / line[1]).is_file(), f"docs/agents.md has no line that runs {name} on the example task"


def test_a_task_in_the_command_is_one_shell_word_whatever_it_holds() -> None:
    rendered = load("codex").render(VALUES)
    assert shlex.split(rendered.command)[-1] == "fix it's bug; rm -rf /"
    [config] = rendered.files
    assert config.path == "/home/.codex/config.toml"
    assert 'base_url = "/openai_base_url"' in config.content  # files are written as is, not quoted


def test_a_manifest_of_ones_own_by_path_with_literal_braces(tmp_path: Path) -> None:
    path = tmp_path / "echo-agent.toml"
    path.write_text(
        'name = "echo-agent"\nversion = "1"\ncommand = "sh {bundle}/run.sh {task_file}"\nuser = "1234"\n'
        '[env]\nKEY = "{api_key}"\n[[files]]\npath = "{home}/c.json"\ncontent = \'{{"model": "{model}"}}\'\n'
        '[install]\nfiles = { "run.sh" = "run.sh" }\n'
    )
    (tmp_path / "run.sh").write_text("echo hi\n")
    manifest = load(str(path))
    rendered = manifest.render(VALUES)
    assert (manifest.name, rendered.user, rendered.env["KEY"]) == ("echo-agent", "1234", "/api_key")
    assert rendered.files[0].content == '{"model": "/model"}'


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('version = "1"\ncommand = "x"', "missing field 'name'"),
        ('name = "a"\nversion = "1"', "missing field 'command'"),
        ('name = "a"\nversion = "1"\ncommand = "run {taks}"', "command: unknown placeholder {taks}"),
        ('name = "a"\nversion = "1"\ncommand = "x"\n[env]\nK = "{key}"', "env.K: unknown placeholder {key}"),
        ('name = "a"\nversion = "1"\ncommand = "x"\ncomand = "y"', "unknown field 'comand'"),
        ('name = "a"\nversion = "1"\ncommand = "x"\n[install]\npypi = ["p==1"]', "needs install.python"),
        ('name = "a"\nversion = "1"\ncommand = "x"\n[install]\npython = "3.9"', "'3.9' is not a Python a bundle"),
        ('name = "a"\nversion = "1"\ncommand = "x"\n[install]\nnode = "18"', "'18' is not a Node a bundle"),
        ('name = "a"\nversion = "1"\ncommand = "x"\n[install]\nfiles = {f = "nope"}', "not a file beside"),
        ('name = "a"\nversion = "1"\ncommand = "x', "not valid TOML"),
    ],
)
def test_a_bad_manifest_says_what_is_wrong_in_one_line(tmp_path: Path, text: str, said: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ManifestError) as caught:
        load(str(path))
    assert said in str(caught.value)
    assert str(path) in str(caught.value)
    assert "\n" not in str(caught.value)


def test_an_unknown_agent_names_the_presets() -> None:
    with pytest.raises(ManifestError, match=r"unknown agent 'codx': the presets are aider, claude-code, cline, "):
        load("codx")
    with pytest.raises(ManifestError, match=r"no manifest file \./nowhere\.toml"):
        load("./nowhere.toml")


def test_trajproxy_run_refuses_a_bad_agent_in_one_line_before_anything_starts(tmp_path: Path) -> None:
    import subprocess
    import sys

    tasks = Path(__file__).parent.parent / "examples" / "tasks" / "calc" / "tasks.jsonl"
    trajproxy = str(Path(sys.executable).parent / "trajproxy")
    (tmp_path / "bad.toml").write_text('name = "bad"\nversion = "1"\ncommand = "go {tsk}"\n')
    for agent, said in [("codx", "unknown agent 'codx'"), (str(tmp_path / "bad.toml"), "unknown placeholder {tsk}")]:
        done = subprocess.run(
            [trajproxy, "run", str(tasks), "--agent", agent, "--bundles", str(tmp_path / "b")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2
        assert said in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "b").exists()
