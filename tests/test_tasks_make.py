"""`trajproxy tasks make` end to end on a real project (toolz's sdist from PyPI): tasks made, built, checked with the
oracle and a no-op agent, then solved by the minimal agent under a scripted policy with its named rewards recorded;
a hostile project whose setup.py reaches for the network and whose CLI tests run it in a subprocess; the bugs the
mutators make; and each bad source refused in one line, leaving nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import secrets
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker.errors
import pytest

from proxy.client import AsyncTrainerClient, TrainerClient
from sandbox.agents.bundles import Bundles
from sandbox.agents.injection import InjectedAgent
from sandbox.agents.manifests import load
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.backends.images import build_image
from sandbox.backends.interface import SandboxError
from sandbox.backends.network_steps import Part, parts
from sandbox.run.policies import ScriptedPolicy
from sandbox.run.runner import Outcome, RunConfig, Runner
from sandbox.tasks.read import read_tasks
from sandbox.tasks.task import Task
from sandbox.tasks.taskmaker.environment import dockerfile
from sandbox.tasks.taskmaker.mutate import KINDS, interleaved, mutations
from sandbox.tasks.taskmaker.project import detect
from sandbox.tasks.taskmaker.write import solution_script
from testkit.sdists import sdist
from tests.conftest import output_of
from tests.test_cli import clean_env

TOOLZ = "toolz==1.2.0"
MAKE = [sys.executable, "-c", "from proxy.cli.main import main; main()", "tasks", "make"]
pytestmark = pytest.mark.timeout(1200)  # image builds and validation runs on a shared 2-core machine
BUGGY = b'''LIMIT = 1 + 2


def total(xs, n, strict=False):
    """Sums."""
    found = 0
    seen = True
    for x in xs[1:]:
        if x < n and not strict:
            found += x * 2
    if found > 10:
        return max(found, n)
    a = 1; b = 2
    return found is None
'''


def make(source: Path, out: Path, *options: str, scratch: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = clean_env(**({"TMPDIR": str(scratch)} if scratch else {}), COLUMNS="200")
    command = [*MAKE, str(source), "--out", str(out), *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=1200, env=env)


@pytest.fixture(scope="module")
def toolz_tasks(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("toolz") / "tasks"
    done = make(sdist(TOOLZ), out, "--max", "2", "--seed", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_tasks_made_from_a_real_project_pass_the_oracle_and_fail_a_no_op(toolz_tasks: Path) -> None:
    summary = json.loads((toolz_tasks / "summary.json").read_text())
    index = [json.loads(line) for line in (toolz_tasks / "tasks.jsonl").read_text().splitlines()]
    made = sorted(path.name for path in toolz_tasks.iterdir() if path.is_dir())
    assert len(index) == 2 and sorted(row["id"] for row in index) == made
    assert summary["tests_passing"] > 150 and summary["flaky"] == []
    for row in index:  # every task written scored 1.0 with the oracle and 0 with an agent that changes nothing
        assert summary["validation"]["oracle"][row["id"]] == 1.0
        assert summary["validation"]["no-op"][row["id"]] == 0.0
        assert row["kind"] in KINDS and row["fail_to_pass"] and "difficulty" not in row
    tasks = list(read_tasks(toolz_tasks))
    assert all(isinstance(task, Task) and task.solver is not None for task in tasks), tasks
    row = index[0]
    folder = toolz_tasks / row["id"]
    said = (folder / "instruction.md").read_text()
    fix = (folder / "solution" / "solve.sh").read_text()
    assert all(f"`{test}`" in said for test in row["fail_to_pass"][:8])
    assert row["files"][0] not in said and Path(row["files"][0]).name not in said  # never where the bug is
    fixed_lines = [line[1:].strip() for line in fix.splitlines() if line.startswith("+") and not line.startswith("++")]
    assert not any(line and line in said for line in fixed_lines)  # nor what the fix is
    toml = (folder / "task.toml").read_text()
    assert 'WEIGHT_TESTS = "0.9"' in toml and "memory_mb = " in toml and "difficulty" not in toml
    spec = json.loads((folder / "tests" / "spec.json").read_text())
    assert spec["fail_to_pass"] == row["fail_to_pass"] and len(spec["pass_to_pass"]) == row["pass_to_pass"]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the store is not what this tests
def test_the_minimal_agent_solves_a_made_task_and_its_named_rewards_are_recorded(
    toolz_tasks: Path, proxied: Any, sandboxes: DockerSandboxes, tmp_path: Path
) -> None:
    [first, *_] = sorted(path for path in toolz_tasks.iterdir() if path.is_dir())
    [task] = list(read_tasks(first))
    assert isinstance(task, Task)
    manifest = load("minimal")
    agent = InjectedAgent(manifest, Bundles().ensure(manifest), None)
    script = tmp_path / "solve.jsonl"
    script.write_text(solution_script(first))
    idle = tmp_path / "idle.jsonl"
    idle.write_text(json.dumps({"content": "Nothing to do.\n```bash\necho TASK_COMPLETE\n```"}) + "\n")
    solved, left = (_run(proxied, sandboxes, task, ScriptedPolicy(path), agent) for path in (script, idle))
    assert (solved.status, solved.reward) == ("finished", 1.0), solved.reason
    assert _rewards(proxied, solved) == {"reward": 1.0, "tests": 1.0, "regressions": 0.0, "style": 1.0}
    assert (left.status, left.reward) == ("finished", 0.0), left.reason
    assert _rewards(proxied, left) == {"reward": 0.0, "tests": 0.0, "regressions": 0.0, "style": 0.0}


def _run(proxied: Any, sandboxes: DockerSandboxes, task: Task, policy: ScriptedPolicy, agent: InjectedAgent) -> Outcome:
    async def main() -> Outcome:
        async with AsyncTrainerClient(proxied.url, proxied.token) as trainer:
            return await Runner(trainer, sandboxes, policy, RunConfig(agent=agent)).run(task)

    return asyncio.run(main())


def _rewards(proxied: Any, outcome: Outcome) -> dict[str, float]:
    assert outcome.episode_id is not None
    with TrainerClient(proxied.url, proxied.token) as trainer:
        recorded = trainer.trajectory(outcome.episode_id).rewards
    return {reward.name: reward.value for reward in recorded}


@contextlib.contextmanager
def listening(engine: Any) -> Iterator[tuple[str, int, list[str]]]:
    """A TCP service on the host, the bridge gateway address builds see it at, and what each connection sent."""
    server = socket.create_server(("0.0.0.0", 0))
    server.settimeout(0.2)
    stop, heard = threading.Event(), list[str]()

    def accept() -> None:
        while not stop.is_set():
            try:
                connection = server.accept()[0]
            except TimeoutError:
                continue
            with connection:
                connection.settimeout(5)
                heard.append(connection.recv(100).decode(errors="replace"))

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    config = engine.networks.get("bridge").attrs["IPAM"]["Config"][0]
    gateway = config.get("Gateway") or str(next(ipaddress.ip_network(config["Subnet"]).hosts()))
    try:
        yield gateway, server.getsockname()[1], heard
    finally:
        stop.set()
        thread.join()
        server.close()


@pytest.fixture
def host_listener(engine: Any) -> Iterator[tuple[str, int, list[str]]]:
    with listening(engine) as found:
        yield found


def reach(gateway: str, port: int, said: str, record: str) -> str:
    """Python that connects to gateway:port, says `said`, and writes to `record` whether it could."""
    return textwrap.dedent(f"""
        import pathlib, socket
        try:
            with socket.create_connection(({gateway!r}, {port}), timeout=10) as s:
                s.sendall({said!r}.encode())
            reached = "connected"
        except OSError as e:
            reached = f"blocked ({{e}})"
        pathlib.Path({record!r}).write_text(reached)
        """)


def test_run_steps_marked_network_none_reach_nothing_on_this_engines_builder(
    engine: Any, host_listener: tuple[str, int, list[str]], tmp_path: Path
) -> None:
    gateway, port, heard = host_listener
    for step in ("first", "offline", "after"):
        (tmp_path / f"{step}.py").write_text(reach(gateway, port, step, f"/{step}.txt"))
    # What a task's Dockerfile says: network for the dependencies, none for the project's own code; a later step
    # without the flag has the network again, as BuildKit gives it.
    (tmp_path / "Dockerfile").write_text(
        "FROM python:3.11-slim\nCOPY *.py /probe/\nARG STEP=first\nRUN python /probe/$STEP.py\n"
        "ENV STAGE=two\nRUN --network=none python /probe/offline.py && test $STEP = first\n"
        "RUN python /probe/after.py\nRUN --network=none \\\n    cat /first.txt /offline.txt /after.txt\n"
    )
    tag = f"trajproxy-test/network-steps:{secrets.token_hex(4)}"
    try:
        assert build_image(engine, tmp_path, tag, 300) is True
        found = output_of(engine, tag, ["sh", "-c", 'for f in /*.txt; do cat "$f"; echo; done'])
        records = found.splitlines()
        assert records[:2] == ["connected", "connected"], records  # after.txt, first.txt
        assert records[2].startswith("blocked"), records  # offline.txt
        assert sorted(heard) == ["after", "first"]
        assert engine.images.get(tag).attrs["Config"]["Env"][-1] == "STAGE=two"
    finally:
        with contextlib.suppress(docker.errors.ImageNotFound):
            engine.images.remove(tag, force=True)


def test_a_dockerfile_the_cut_cannot_keep_is_refused_in_one_line_and_one_without_the_flag_is_left_whole() -> None:
    plain = "FROM python:3.11-slim\nRUN echo hi\n"
    assert parts(plain) == [Part(plain, None)]
    for text in (
        "FROM python:3.11-slim AS build\nRUN --network=none true\nFROM build\nRUN true\n",
        "FROM python:3.11-slim\nONBUILD RUN true\nRUN --network=none true\n",
        "FROM python:3.11-slim\nRUN --network=host true\n",
    ):
        with pytest.raises(SandboxError) as refused:
            parts(text)
        assert len(str(refused.value).splitlines()) == 1 and "--network" in str(refused.value)


NETCALC = {
    "netcalc.py": '''\
        """A calculator with a command line."""
        import sys


        def add(a, b):
            return a + b


        def main(argv):
            print(add(int(argv[0]), int(argv[1])))


        if __name__ == "__main__":
            main(sys.argv[1:])
        ''',
    "tests/test_netcalc.py": """\
        import netcalc
        from netcalc import add


        def test_add():
            assert add(2, 3) == 5


        def test_add_zero():
            assert add(0, 4) == 4


        def test_documented():
            assert netcalc.__doc__.startswith("A calculator")
        """,
    # The project run as users run it: in a process of its own, which coverage never sees.
    "tests/test_cli.py": """\
        import subprocess
        import sys


        def test_the_command_line_adds():
            ran = subprocess.run([sys.executable, "-m", "netcalc", "2", "3"], capture_output=True, text=True, env={})
            assert ran.stdout.strip() == "5", ran.stderr
        """,
}
CLI_TEST = "tests/test_cli.py::test_the_command_line_adds"


# The project's name, which names its images: one of this run's own, as the engine may hold another run's at once
NETCALC_NAME = f"netcalc{secrets.token_hex(4)}"


@pytest.fixture(scope="module")
def hostile_tasks(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    """Tasks made from a project whose setup.py connects to a service on the host when it can, and records whether."""
    with listening(engine) as (gateway, port, heard):
        source = _project(tmp_path_factory.mktemp("netcalc") / NETCALC_NAME, NETCALC)
        setup = reach(gateway, port, "setup.py", "network.txt")
        declared = (
            f'from setuptools import setup\n\nsetup(name="{NETCALC_NAME}", version="1.0", py_modules=["netcalc"])\n'
        )
        (source / "setup.py").write_text(f"{setup}\n{declared}")
        out = source.parent / "tasks"
        done = make(source, out, "--max", "1", "--seed", "3")
        assert done.returncode == 0, done.stdout + done.stderr
        yield out, heard
    for tag in {tag for image in engine.images.list() for tag in image.tags}:
        if tag.startswith(f"trajproxy-task/{NETCALC_NAME}-"):  # its base image and its tasks'
            engine.images.remove(tag, force=True)


def test_a_projects_own_setup_py_runs_with_no_network_while_its_image_builds(
    engine: Any, hostile_tasks: tuple[Path, list[str]]
) -> None:
    out, heard = hostile_tasks
    assert heard == []  # nothing of the project's reached the host
    [base] = engine.images.list(name=f"trajproxy-task/{NETCALC_NAME}-base")
    recorded = output_of(engine, base.id, ["cat", "/app/network.txt"])
    assert recorded.startswith("blocked"), recorded  # its setup.py did run, and found no network
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["tasks"]) == 1 and summary["validation"]["oracle"] == {summary["tasks"][0]["id"]: 1.0}


def test_tests_that_run_the_project_in_a_subprocess_are_judged_on_the_buggy_tree(
    hostile_tasks: tuple[Path, list[str]],
) -> None:
    out, _ = hostile_tasks
    [row] = [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()]
    spec = json.loads((out / row["id"] / "tests" / "spec.json").read_text())
    # Coverage never saw the CLI test run `add`, but the bug in `add` breaks it: it is to be fixed, not kept passing.
    assert CLI_TEST in spec["fail_to_pass"] and CLI_TEST in row["fail_to_pass"]
    assert spec["pass_to_pass"] == ["tests/test_netcalc.py::test_documented"] and row["pass_to_pass"] == 1
    said = (out / row["id"] / "instruction.md").read_text()
    assert f"`{CLI_TEST}`" in said
    assert "the 1 other test that passed before still passes" in said, said
    assert "difficulty" not in row and "difficulty" not in (out / row["id"] / "task.toml").read_text()


def test_the_mutators_make_each_kind_of_bug_inside_functions_only() -> None:
    found = mutations("m.py", BUGGY)
    assert {m.kind for m in found} == set(KINDS)
    assert all(m.line >= 4 for m in found)  # nothing at module level (LIMIT = 1 + 2)
    assert not any(m.kind == "dropped-line" and m.line in (5, 13) for m in found)  # a docstring, a shared line
    by = {(m.kind, m.description): m.apply(BUGGY).decode() for m in found}
    assert "        if x <= n and not strict:\n" in by["comparison", "`<` became `<=`"]
    assert "            found -= x * 2\n" in by["operator", "`+=` became `-=`"]
    assert "    for x in xs[0:]:\n" in by["off-by-one", "`1` became `0`"]
    assert "        return max(n, found)\n" in by["swapped-args", "the first two arguments swapped"]
    assert "        if x < n and strict:\n" in by["boolean", "`not` dropped"]
    assert "return max" not in by["dropped-branch", "lines 11-12 dropped"]
    assert "    seen = True\n" not in by["dropped-line", "line 7 dropped"]
    assert "    seen = False\n" in by["constant", "`True` became `False`"]
    for mutation in found:  # each still compiles, and changes only the lines it says
        changed = mutation.apply(BUGGY).decode().splitlines()
        compile("\n".join(changed), "m.py", "exec")
    order = [(m.kind, m.line, m.description) for m in interleaved(found, 7)]
    assert order == [(m.kind, m.line, m.description) for m in interleaved(list(reversed(found)), 7)]
    assert order != [(m.kind, m.line, m.description) for m in interleaved(found, 8)]
    assert len({kind for kind, _, _ in order[:6]}) == 6  # kinds vary from the start


def test_test_dependencies_are_read_from_where_projects_declare_them(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "core.py").write_text("def f():\n    return 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_core.py").write_text("def test_f():\n    pass\n")
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "My_Pkg"\n[project.optional-dependencies]\ntest = ["hypothesis>=6"]\n'
    )
    (tmp_path / "tox.ini").write_text("[testenv]\ndeps =\n    freezegun\n    py38: mock\n    -r requirements.txt\n")
    (tmp_path / "requirements-test.txt").write_text("# pinned\npytest-mock==3.14.0\n\n")
    project = detect(tmp_path, tmp_path)
    assert project.name == "my-pkg" and project.installable
    assert project.test_requirements == ("hypothesis>=6", "freezegun", "pytest-mock==3.14.0")
    assert project.source_files == ("pkg/core.py",) and project.test_files == ("tests/test_core.py",)


def test_what_a_project_needs_is_read_from_its_files_never_by_running_them(tmp_path: Path) -> None:
    (tmp_path / "calc.py").write_text(CALC)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_calc.py").write_text("def test_add():\n    pass\n")
    (tmp_path / "setup.py").write_text(
        "raise SystemExit('never run')\nREQUIRES = ['requests>=2', 'evil @ https://example.invalid/evil.tar.gz']\n"
        "setup(name='Calc', install_requires=REQUIRES, tests_require=['mock'],\n"
        "      extras_require={'test': ['pytest-xdist'], 'docs': ['sphinx']})\n"
    )
    (tmp_path / "requirements.txt").write_text(
        "attrs\n--index-url http://example.invalid/simple\n-e git+https://example.invalid/x\n"
        "six; python_version > '3' $(touch /tmp/pwned)\n"
    )
    project = detect(tmp_path, tmp_path)
    assert project.name == "calc"
    assert project.dependencies == ("requests>=2", "attrs", "six; python_version > '3' $(touch /tmp/pwned)")
    assert project.build_requirements == ("setuptools>=40.8.0", "wheel")
    assert project.test_requirements == ("pytest-xdist", "mock")
    built = dockerfile(project, with_bug=False)
    assert "'six; python_version > '\"'\"'3'\"'\"' $(touch /tmp/pwned)'" in built  # quoted: the shell runs nothing
    network, offline = built.split("COPY project/")  # nothing of the project's before the step with the network ends
    assert "requests>=2" in network and all(
        line.startswith(("RUN --network=none ", "WORKDIR", "ENV")) for line in offline.splitlines()[1:]
    )


def _project(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(textwrap.dedent(text))
    return folder


CALC = "def add(a, b):\n    return a + b\n"
BAD_SOURCES: dict[str, tuple[dict[str, str] | None, str]] = {
    "missing": (None, "no such file or folder"),
    "notes.txt": (None, "not a repository, a folder or an archive"),
    "js": ({"package.json": "{}", "index.js": "module.exports = 1\n"}, "a JavaScript/TypeScript project"),
    "untested": ({"calc.py": CALC}, "no tests found"),
    "failing": (
        {"calc.py": CALC, "tests/test_calc.py": "from calc import add\n\ndef test_add():\n    assert add(1, 1) == 3\n"},
        "no passing tests: of 1 tests none passes twice (1 fail",
    ),
    "uncollectable": (
        {"calc.py": CALC, "tests/test_calc.py": "import no_such_module\n\ndef test_add():\n    pass\n"},
        "no test runs: collecting them failed",
    ),
    "unbuildable": (
        {
            "calc.py": CALC,
            "tests/test_calc.py": "def test_add():\n    pass\n",
            "requirements-test.txt": "trajproxy-no-such-package-0xdead==1.0\n",
        },
        "the project's image does not build",
    ),
}


def test_bad_sources_are_refused_in_one_line_and_leave_nothing_behind(engine: Any, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    for name, (files, _) in BAD_SOURCES.items():
        if name.endswith(".txt"):
            (tmp_path / name).write_text("not code\n")
        elif files is not None:
            _project(tmp_path / name, files)

    def refused(name: str) -> subprocess.CompletedProcess[str]:
        return make(tmp_path / name, tmp_path / f"out-{name}", "--max", "1", scratch=scratch)

    with ThreadPoolExecutor(len(BAD_SOURCES)) as pool:  # most of each is waiting: on a build, on PyPI
        done = dict(zip(BAD_SOURCES, pool.map(refused, BAD_SOURCES), strict=True))
    for name, (_, said) in BAD_SOURCES.items():
        ran = done[name]
        lines = [line for line in ran.stdout.splitlines() + ran.stderr.splitlines() if "tasks make:" in line]
        assert ran.returncode == 1 and len(lines) == 1, (name, ran.stdout, ran.stderr)
        assert said in lines[0] and str(tmp_path / name) in lines[0], (name, lines[0])
        assert not (tmp_path / f"out-{name}").exists(), name
    assert list(scratch.iterdir()) == []  # no scratch folder left
    tags = {tag for image in engine.images.list() for tag in image.tags}
    assert not [tag for tag in tags for name in BAD_SOURCES if tag.startswith(f"trajproxy-task/{name}-base:")]
