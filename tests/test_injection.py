"""Real agents injected into task images that were never built for them: each preset's bundle, mounted read-only
into an older Debian (glibc 2.31) with no Python and no Node, run as a non-root user on a read-only root, solves
a task whose tests are a shell script, answered by a scripted policy in the agent's own dialect, reward 1.0.

Bundles are built once per machine (~/.cache/trajproxy/bundles, or $TRAJPROXY_BUNDLES) and once per session here."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from proxy.app import create_app
from proxy.client import AsyncTrainerClient, TrainerClient
from proxy.settings import Settings
from proxy.storage.content import turns
from proxy.storage.export import source
from proxy.storage.stored_turns import turns_of
from sandbox.agents.bundles import Bundle, BundleError, Bundles
from sandbox.agents.injection import InjectedAgent
from sandbox.agents.manifests import load
from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.run.runner import Outcome, RunConfig, Runner
from sandbox.tasks.formats.jsonl import ExitCode
from sandbox.tasks.task import Task
from testkit.presets import BARE, BARE_DOCKERFILE, OLD, OLD_BASE, OLD_DOCKERFILE, PRESETS, TASK, text_commands
from tests.conftest import new_token, serve_app


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/trajproxy.db"


class Received:
    """The app, with every request body it received kept as it arrived (bytes), to hold what trajproxy stored of
    each real agent's calls against what the agent sent."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.bodies: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def receiving() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.bodies.append(b"".join(chunks))
            return message

        await self.app(scope, receiving, send)


@pytest.fixture
def proxied(database_url: str, socket_dir: str) -> Iterator[Any]:
    """trajproxy on the test's database and the sandboxes' socket, keeping the bodies it received (`Received`)."""
    settings = Settings(
        _env_file=None,
        database_url=database_url,
        socket_path=f"{socket_dir}/proxy.sock",
        trainer_token=new_token(),
        keepalive_s=0.2,  # the timings conftest's servers have
        turn_timeout_s=30.0,
        lease_s=30.0,
        retry_grace_s=0.3,
    )
    app = create_app(settings)
    running = serve_app(Received(app), app.settings)
    yield running.live
    running.stop()


@pytest.fixture(scope="session")
def bundles() -> Bundles:
    return Bundles()


@pytest.fixture(scope="session")
def built(bundles: Bundles) -> Callable[[str], Bundle]:
    """Each agent's bundle, built at most once a session (and reused across sessions from the bundles folder)."""
    made: dict[str, Bundle] = {}

    def get(name: str) -> Bundle:
        if name not in made:
            try:
                made[name] = bundles.ensure(load(name))
            except BundleError as e:
                if "npm is needed" not in str(e) or os.environ.get("CI"):
                    raise
                pytest.skip(f"{e} (bash .ci/run installs it)")
        return made[name]

    return get


def _image(engine: Any, tag: str, dockerfile: str, tmp: Path) -> str:
    (tmp / "Dockerfile").write_text(dockerfile)
    engine.images.build(path=str(tmp), tag=tag, rm=True)
    return tag


@pytest.fixture(scope="session")
def bare_image(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _image(engine, BARE, BARE_DOCKERFILE, tmp_path_factory.mktemp("bare"))


@pytest.fixture(scope="session")
def old_image(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    try:
        engine.images.get(OLD_BASE)
    except Exception as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the {OLD_BASE} tests: {e} (.ci/run builds it with docker-up --bullseye)")
        pytest.skip(f"{OLD_BASE} is not on this engine; ../shared/tools/docker-up --bullseye builds it")
    return _image(engine, OLD, OLD_DOCKERFILE, tmp_path_factory.mktemp("old"))


class Scripted:
    def __init__(self, answer: Callable[[Any], dict[str, Any]]) -> None:
        self.answer = answer

    async def serve(self, trainer: AsyncTrainerClient, episode_id: str) -> None:
        while True:
            for turn in await trainer.next_turns(episode=episode_id, max=8, wait_s=5):
                await trainer.reply(turn.id, message=self.answer(turn), lease_id=turn.lease_id)


def run_one(
    proxied: Any, sandboxes: DockerSandboxes, agent: InjectedAgent, image: str, policy: Any, task: Task | None = None,
    **config: Any,
) -> Outcome:  # fmt: skip
    task = task or Task(TASK, image, "/repo", ExitCode("sh test.sh"))

    async def main() -> Outcome:
        async with AsyncTrainerClient(proxied.url, proxied.token) as trainer:
            runner = Runner(trainer, sandboxes, Scripted(policy), RunConfig(agent=agent, agent_timeout_s=180, **config))
            return await runner.run(task)

    return asyncio.run(main())


def check_solved(proxied: Any, outcome: Outcome, agent: InjectedAgent, dialect: str) -> None:
    assert (outcome.status, outcome.reward) == ("finished", 1.0), f"{outcome.reason}\n{outcome.agent_output}"
    # The agent's change is the episode's diff: nothing committed out of it, none of the agent's own files in it.
    assert re.findall(r"^diff --git a/(\S+) ", outcome.diff, re.MULTILINE) == ["hello.txt"], outcome.diff[:2000]
    assert outcome.episode_id is not None
    with TrainerClient(proxied.url, proxied.token) as trainer:
        recorded = trainer.trajectory(outcome.episode_id)
    assert recorded.episode.metadata["agent"] == agent.record
    trained = [turn for turn in recorded.turns if turn.trainable]  # side calls a manifest routes away are not
    assert trained and {turn.dialect for turn in trained} == {dialect}
    assert all(turn.status == "answered" for turn in trained)
    assert recorded.rewards[0].value == 1.0
    # What is stored of each call, put back together from its pieces, is the body the agent sent, byte for byte, and
    # the request every reader gives (the trainer API's here) is the one stored.
    engine = source(proxied.settings.database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(turns).where(turns.c.episode_id == outcome.episode_id).order_by(turns.c.seq))
            stored = turns_of(conn, rows.all())
    finally:
        engine.dispose()
    assert [turn.id for turn in stored] == [turn.id for turn in recorded.turns]
    for turn, via_api in zip(stored, recorded.turns, strict=True):
        assert turn.wire in proxied.app.bodies, f"turn {turn.id}: its stored body is not what the agent sent"
        assert turn.request == via_api.request


# Its own stage in .ci/run, a few at once (pytest -n): a preset on one worker, which builds its bundle.
CONFORMANCE = [pytest.param(name, marks=[pytest.mark.conformance, pytest.mark.xdist_group(name)]) for name in PRESETS]


@pytest.mark.timeout(900)  # (a preset's bundle is built here: minutes, cold)
@pytest.mark.parametrize("name", CONFORMANCE)
def test_each_preset_solves_a_task_on_an_older_debian_with_no_python_and_no_node_as_a_non_root_user_on_a_read_only_root(
    proxied: Any, sandboxes: DockerSandboxes, built: Callable[[str], Bundle], old_image: str, name: str
) -> None:
    """All of what a task image may lack at once: Debian 11 (glibc 2.31), no Python and no Node, a non-root user,
    and `--read-only`: the agent writes its HOME (under /tmp) and the task's repository, nothing else. Graded in
    place, in the agent's own container once it stopped: the tests pass there, and its root refuses a write. (The
    grader's own container, the default, grades the other tests' runs.)"""
    dialect, policy = PRESETS[name]
    agent = InjectedAgent(load(name), built(name))
    refused = "touch /trajproxy-probe 2>&1 | grep -q 'Read-only file system'"
    task = Task(TASK, old_image, "/repo", ExitCode(f"sh test.sh && {refused}"), grading="in-place")
    check_solved(proxied, run_one(proxied, sandboxes, agent, old_image, policy, task, read_only=True), agent, dialect)


@pytest.mark.timeout(300)
def test_an_agent_from_a_manifest_file_alone(
    proxied: Any, sandboxes: DockerSandboxes, bundles: Bundles, bare_image: str, tmp_path: Path
) -> None:
    """An agent of one's own, added with a manifest and a shell script beside it and no code in trajproxy: it reads
    its templated config file, asks the policy once (on the Python its bundle carries; the image has none) and
    runs the command it is given."""
    (tmp_path / "agent.sh").write_text(
        '#!/bin/sh\nset -e\n. "$HOME/agent.env"\ncd "$WORKDIR"\n'
        '"$PY" -c "import json,os,urllib.request as u;'
        "r=u.Request(os.environ['BASE']+'/chat/completions',json.dumps({'model':'m','messages':"
        "[{'role':'user','content':open(os.environ['TASK_FILE']).read()}]}).encode(),"
        "{'authorization':'Bearer '+os.environ['KEY'],'content-type':'application/json'});"
        "print(json.load(u.urlopen(r))['choices'][0]['message']['content'])\" > /tmp/command.sh\n"
        "sh /tmp/command.sh\n"
    )
    (tmp_path / "shell-agent.toml").write_text(
        'name = "shell-agent"\nversion = "1.0"\ncommand = "sh {bundle}/agent.sh"\n'
        '[env]\nHOME = "{home}"\n'
        '[[files]]\npath = "{home}/agent.env"\ncontent = """\nexport BASE={openai_base_url} KEY={api_key}\n'
        'export WORKDIR={workdir} TASK_FILE={task_file} PY={bundle}/bin/python3\n"""\n'
        '[install]\npython = true\nfiles = { "agent.sh" = "agent.sh" }\n'
    )
    manifest = load(str(tmp_path / "shell-agent.toml"))
    agent = InjectedAgent(manifest, bundles.ensure(manifest))
    outcome = run_one(proxied, sandboxes, agent, bare_image, lambda turn: {"content": "echo hi > hello.txt"})
    check_solved(proxied, outcome, agent, "chat")


NODE_AGENT = """
const { spawnSync, execSync } = require("child_process");
const fs = require("fs");
if (typeof gc !== "function") {  // first start: a Node child of its own, then relaunch with a V8 flag
  const child = spawnSync(process.execPath, ["-e", "process.stdout.write(String(6 * 7))"], { encoding: "utf8" });
  if (child.stdout !== "42") throw new Error(`the child exited ${child.status}: ${child.stderr}`);
  const again = spawnSync(process.execPath, ["--expose-gc", "--max-old-space-size=512", ...process.argv.slice(1)], {
    stdio: "inherit",
  });
  process.exit(again.status);
}
const env = process.env;
fetch(env.BASE + "/chat/completions", {
  method: "POST",
  headers: { authorization: "Bearer " + env.KEY, "content-type": "application/json" },
  body: JSON.stringify({ model: "m", messages: [{ role: "user", content: fs.readFileSync(env.TASK_FILE, "utf8") }] }),
})
  .then((reply) => reply.json())
  .then((body) => execSync(body.choices[0].message.content, { cwd: env.WORKDIR, stdio: "inherit" }));
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("image", ["bare_image", "old_image"])
def test_a_node_agent_relaunches_itself_and_starts_node_children_from_its_bundle(
    proxied: Any, sandboxes: DockerSandboxes, bundles: Bundles, tmp_path: Path, request: Any, image: str
) -> None:
    """`install.node` carries Node as a program that runs directly: `process.execPath` is the real node, which the
    agent starts again with V8 flags (as Qwen Code and Gemini CLI do) and as a child (workers, MCP servers)."""
    (tmp_path / "agent.js").write_text(NODE_AGENT)
    (tmp_path / "node-agent.toml").write_text(
        'name = "node-agent"\nversion = "1.0"\ncommand = "{bundle}/bin/node {bundle}/agent.js"\n'
        '[env]\nBASE = "{openai_base_url}"\nKEY = "{api_key}"\nTASK_FILE = "{task_file}"\nWORKDIR = "{workdir}"\n'
        '[install]\nnode = "22"\nfiles = { "agent.js" = "agent.js" }\n'
    )
    manifest = load(str(tmp_path / "node-agent.toml"))
    agent = InjectedAgent(manifest, bundles.ensure(manifest))
    outcome = run_one(
        proxied, sandboxes, agent, request.getfixturevalue(image), lambda _: {"content": "echo hi > hello.txt"}
    )
    check_solved(proxied, outcome, agent, "chat")


def test_a_second_build_of_a_manifest_keeps_the_first_ones_bundle_unless_told_to_replace_it(tmp_path: Path) -> None:
    """Two runs that find no bundle both build it: the one finishing last keeps the first's, which agents may be
    running from (it used to delete it and put its own in its place)."""
    (tmp_path / "files.toml").write_text('name = "files"\nversion = "1"\ncommand = "x"\n')
    manifest = load(str(tmp_path / "files.toml"))
    bundles = Bundles(tmp_path / "bundles")
    first = bundles.build(manifest)
    in_use = first.path / "in-use"  # what a running agent's view of the first bundle would lose with it
    in_use.write_text("mounted")
    second = bundles.build(manifest)
    assert second == first and in_use.read_text() == "mounted"
    assert [path.name for path in (tmp_path / "bundles").iterdir()] == [first.digest]  # its own build removed
    replaced = bundles.build(manifest, replace=True)
    assert replaced.path == first.path and not in_use.exists()


def test_a_failed_build_gives_the_registrys_message_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "broken.toml").write_text(
        'name = "broken"\nversion = "0"\ncommand = "x"\n[install]\nnpm = ["@openai/codex@0.0.0-no-such-version"]\n'
    )
    bundles = Bundles(tmp_path / "bundles")
    with pytest.raises(BundleError, match=r"npm install @openai/codex@0\.0\.0-no-such-version: .*(ETARGET|notarget)"):
        bundles.build(load(str(tmp_path / "broken.toml")))
    assert list((tmp_path / "bundles").iterdir()) == []


def test_a_package_for_another_python_is_refused_with_the_lines_that_say_why(tmp_path: Path) -> None:
    """OpenHands' CLI needs Python 3.12: on 3.11 uv finds no version, and says why in the line the message keeps."""
    (tmp_path / "old-python.toml").write_text(
        'name = "old-python"\nversion = "0"\ncommand = "x"\n[install]\npython = "3.11"\npypi = ["openhands==1.16.0"]\n'
    )
    bundles = Bundles(tmp_path / "bundles")
    with pytest.raises(BundleError) as failed:
        bundles.build(load(str(tmp_path / "old-python.toml")))
    said = str(failed.value)
    assert said.startswith("old-python: error: No solution found when resolving dependencies"), said
    assert "does not satisfy Python>=3.12" in said and "openhands==1.16.0" in said, said
    assert "\n" not in said
    assert list((tmp_path / "bundles").iterdir()) == []


def test_an_image_the_bundle_cannot_run_in_is_refused_saying_why(
    proxied: Any, sandboxes: DockerSandboxes, built: Callable[[str], Bundle], bare_image: str
) -> None:
    foreign = InjectedAgent(load("codex"), replace(built("codex"), arch="arm64"))
    outcome = run_one(proxied, sandboxes, foreign, bare_image, text_commands)
    assert outcome.status == "failed"
    assert "the agent bundle is built for arm64" in outcome.reason
    assert "amd64: it cannot run there" in outcome.reason


def test_a_failing_agent_says_why_and_its_output_is_kept_with_the_episode(
    proxied: Any, sandboxes: DockerSandboxes, bundles: Bundles, bare_image: str, tmp_path: Path
) -> None:
    (tmp_path / "typo.toml").write_text('name = "typo"\nversion = "1"\ncommand = "{bundle}/bin/pyhton3 -V"\n')
    manifest = load(str(tmp_path / "typo.toml"))
    agent = InjectedAgent(manifest, bundles.ensure(manifest))
    outcome = run_one(proxied, sandboxes, agent, bare_image, text_commands)
    assert outcome.status == "failed"
    said = r"the agent exited with 127: sh: \d+: /opt/trajproxy/agent/bin/pyhton3: not found"
    assert re.fullmatch(said, outcome.reason), outcome.reason
    assert outcome.episode_id is not None
    with TrainerClient(proxied.url, proxied.token) as trainer:
        recorded = trainer.trajectory(outcome.episode_id)
    assert "pyhton3: not found" in recorded.rewards[0].info["agent_output"]
    assert recorded.episode.reason == outcome.reason


def test_a_manifests_routes_and_its_agent_are_on_every_episode_it_runs(
    proxied: Any, sandboxes: DockerSandboxes, tmp_path: Path
) -> None:
    (tmp_path / "routed.toml").write_text(
        'name = "routed"\nversion = "2"\ncommand = "x"\n'
        '[[routes]]\nmodel = "openai/gpt-4o-mini"\nwhen_model = "*-haiku*"\n'
    )
    manifest = load(str(tmp_path / "routed.toml"))
    bundle = Bundle("routed", "2", "d" * 24, 0, "amd64", 0.0, tmp_path)
    agent = InjectedAgent(manifest, bundle)

    async def main() -> Any:
        async with AsyncTrainerClient(proxied.url, proxied.token) as trainer:
            runner = Runner(trainer, sandboxes, Scripted(text_commands), RunConfig(agent=agent))
            created = await runner.open(Task(TASK, BARE, "/repo", ExitCode("true")))
            return await trainer.episode(created.id)

    episode = asyncio.run(main())
    assert [(r.model, r.when_model) for r in episode.routes] == [("openai/gpt-4o-mini", "*-haiku*")]
    assert episode.metadata["agent"] == {"name": "routed", "version": "2", "bundle": "d" * 24}
