"""`trajproxy export`: recorded episodes out as JSONL in chat and token shape, filtered, loadable by `datasets`,
and streamed in flat memory."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import sqlite3
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from unittest import mock

import datasets
import pytest

from proxy.cli.main import main
from proxy.client import TrainerClient
from proxy.core.values import Episode, EpisodeStatus, Reply, Turn, TurnStatus, hash_key, new_id, new_key
from proxy.storage.export import Filters, Shape, export, source
from proxy.storage.sql import SqlStore
from tests.test_cli import clean_env, trajproxy_script
from tests.test_storage_upgrade import recorded_by_previous
from tests.test_trainer_api import agent_for

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

SYSTEM = {"role": "system", "content": "you fix bugs"}
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def run_export(url: str, out: Path | str, *flags: str) -> subprocess.CompletedProcess[str]:
    """`trajproxy export` run in this process, as its command line runs it: its exit status and what it said. (A new
    process's start-up, seconds of imports, proves nothing here: test_exported_files_load_with_datasets runs the
    installed command.)"""
    args = ["export", str(out), "--database-url", url, "--quiet", *flags]
    said = io.StringIO()
    with contextlib.redirect_stderr(said), mock.patch.dict(os.environ, COLUMNS="400"):  # messages on one line
        try:
            main(args)
        except SystemExit as ended:
            status = ended.code
    assert isinstance(status, int), status
    return subprocess.CompletedProcess(args, status, "", said.getvalue())


def run_export_command(url: str, out: Path | str, *flags: str) -> subprocess.CompletedProcess[str]:
    """`trajproxy export`, the installed command in a process of its own."""
    return subprocess.run(
        [trajproxy_script(), "export", str(out), "--database-url", url, "--quiet", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(COLUMNS="400"),  # messages on one line
    )


def lines_of(url: str, tmp_path: Path, *flags: str) -> list[dict[str, Any]]:
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.jsonl"
    done = run_export(url, out, *flags)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture
def recorded(server: Any, trainer: TrainerClient, background: Any) -> dict[str, Any]:
    """Three episodes: a rewarded one with token ids over two branches, a failed one, a cancelled one."""

    def turn(episode: Any, messages: list[Any], reply: dict[str, Any], **extras: Any) -> Any:
        with agent_for(episode) as agent:
            call = background(agent.chat.completions.create, model="m", messages=messages, tools=TOOLS)
            [parked] = trainer.next_turns(episode=episode.id, wait_s=5)
            trainer.reply(parked.id, message=reply, **extras)
            return call.result(timeout=10).choices[0].message.model_dump(exclude_none=True)

    good = trainer.create_episode(task="fix calc", metadata={"split": "train", "n": 1})
    history: list[Any] = [SYSTEM, {"role": "user", "content": "fix calc.py"}]
    calls = [{"id": "c1", "function": {"name": "bash", "arguments": '{"cmd": "cat calc.py"}'}}]
    extras = {"prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5], "logprobs": [-0.5, -0.25]}
    history += [turn(good, history, {"tool_calls": calls}, policy_version="v1", **extras)]
    history += [{"role": "tool", "tool_call_id": "c1", "content": "def add(a, b): return a - b"}]
    extras = {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7], "completion_token_ids": [8], "logprobs": [-1.0]}
    turn(good, history, {"content": "fixed"}, policy_version="v2", **extras)
    compacted = [SYSTEM, {"role": "user", "content": "summary: add subtracted; fixed it"}]
    extras = {"prompt_token_ids": [1, 9], "completion_token_ids": [10], "logprobs": [-2.0]}
    turn(good, compacted, {"content": "done"}, **extras)
    trainer.add_reward(good.id, 1.0, source="grader")
    trainer.add_reward(good.id, 0.5, name="style")
    trainer.finish(good.id)

    bad = trainer.create_episode(task="fix calc", metadata={"split": "eval", "n": 2})
    turn(bad, [SYSTEM, {"role": "user", "content": "fix it"}], {"content": "no"})
    trainer.add_reward(bad.id, 0.0, source="grader")
    trainer.finish(bad.id, "failed", "tests fail")

    stopped = trainer.create_episode(task="other", metadata={"split": "train", "n": "three"})
    turn(stopped, [{"role": "user", "content": [{"type": "text", "text": "in parts"}]}], {"content": "ok"})
    trainer.finish(stopped.id, "cancelled")
    return {"url": server.settings.database_url, "good": good.id, "bad": bad.id, "stopped": stopped.id}


def test_chat_shape_writes_each_branch_with_its_rewards(recorded: dict[str, Any], tmp_path: Path) -> None:
    lines = lines_of(recorded["url"], tmp_path)
    assert [(line["episode_id"], line["branch"]) for line in lines] == [
        (recorded["good"], 0),
        (recorded["good"], 1),
        (recorded["bad"], 0),
        (recorded["stopped"], 0),
    ]
    main, compacted, bad, stopped = lines
    assert [m["role"] for m in main["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert main["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"cmd": "cat calc.py"}'
    assert main["messages"][-1] == {"role": "assistant", "content": "fixed"}
    assert (main["turns"], main["policy_version"], main["reward"]) == (2, "v2", 1.0)  # the one named reward
    assert main["rewards"] == {"reward": 1.0, "style": 0.5}
    assert json.loads(main["tools"]) == TOOLS and json.loads(main["metadata"]) == {"split": "train", "n": 1}
    assert compacted["messages"][-1]["content"] == "done" and compacted["turns"] == 1
    assert (bad["status"], bad["reward"]) == ("failed", 0.0)
    assert stopped["reward"] is None and stopped["messages"][0] == {"role": "user", "content": "in parts"}


def test_token_shape_joins_a_branch_into_one_sequence_with_a_loss_mask(
    recorded: dict[str, Any], tmp_path: Path
) -> None:
    lines = lines_of(recorded["url"], tmp_path, "--shape", "tokens")
    assert [(line["episode_id"], line["branch"]) for line in lines] == [(recorded["good"], 0), (recorded["good"], 1)]
    main, compacted = lines
    assert main["prompt_ids"] == [1, 2, 3]
    assert main["completion_ids"] == [4, 5, 6, 7, 8]  # policy, environment (the tool's output), policy
    assert main["loss_mask"] == [1, 1, 0, 0, 1]
    assert main["logprobs"] == [-0.5, -0.25, 0.0, 0.0, -1.0]
    assert (main["policy_versions"], main["reward"]) == (["v1", "v2"], 1.0)
    assert (compacted["prompt_ids"], compacted["completion_ids"], compacted["loss_mask"]) == ([1, 9], [10], [1])


def test_filters_pick_episodes(recorded: dict[str, Any], tmp_path: Path) -> None:
    def episodes(*flags: str) -> list[str]:
        return sorted({line["episode_id"] for line in lines_of(recorded["url"], tmp_path, *flags)})

    good, bad, stopped = recorded["good"], recorded["bad"], recorded["stopped"]
    assert episodes("--min-reward", "0.5") == [good]
    assert episodes("--max-reward", "0.5") == [bad]  # an episode with no reward is not in any reward range
    assert episodes("--status", "failed", "--status", "cancelled") == sorted([bad, stopped])
    assert episodes("--where", "split=train") == sorted([good, stopped])
    assert episodes("--where", "split=train", "--where", "n=1") == [good]
    assert episodes("--where", 'n="three"') == [stopped]
    assert episodes("--since", "2999-01-01") == []
    assert episodes("--until", "2999-01-01T00:00:00+00:00") == sorted([good, bad, stopped])


def test_exported_files_load_with_datasets(recorded: dict[str, Any], tmp_path: Path) -> None:
    for shape, rows in (("chat", 4), ("tokens", 2)):
        out = tmp_path / f"{shape}.jsonl"
        assert run_export_command(recorded["url"], out, "--shape", shape).returncode == 0
        dataset = datasets.load_dataset("json", data_files=str(out), split="train")
        assert dataset.num_rows == rows
        if shape == "chat":
            assert dataset[0]["messages"][-1]["content"] == "fixed" and dataset[0]["reward"] == 1.0
        else:
            assert dataset[0]["loss_mask"] == [1, 1, 0, 0, 1]


def test_bad_export_arguments_say_what_is_wrong(tmp_path: Path, database_url: str) -> None:
    missing = run_export(f"sqlite:///{tmp_path}/nothing.db", tmp_path / "out.jsonl")
    assert missing.returncode == 2 and "no database at" in missing.stderr
    assert not (tmp_path / "nothing.db").exists()
    where = run_export(f"sqlite:///{tmp_path}/nothing.db", tmp_path / "out.jsonl", "--where", "split")
    assert where.returncode == 2 and "expected key=value" in where.stderr
    since = run_export(database_url, tmp_path / "out.jsonl", "--since", "last tuesday")
    assert since.returncode == 2 and "last tuesday" in since.stderr
    shape = run_export(database_url, tmp_path / "out.jsonl", "--shape", "parquet")
    assert shape.returncode == 2 and "invalid choice" in shape.stderr
    if database_url.startswith("sqlite"):
        sqlite3.connect(database_url.removeprefix("sqlite:///")).execute("VACUUM").connection.close()
    empty = run_export(database_url, tmp_path / "out.jsonl")  # a database trajproxy never served
    assert empty.returncode == 2 and "no trajproxy tables" in empty.stderr


def test_what_export_cannot_use_is_refused_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/trajproxy.db"
    seed(url, 1, 1)
    other = tmp_path / "other.db"  # a SQLite file of someone else's, with a table named as one of trajproxy's
    sqlite3.connect(other).execute("CREATE TABLE turn (x INTEGER)").connection.close()
    out = tmp_path / "out.jsonl"
    for target, flags, status, said in (
        (tmp_path / "no-such-folder" / "out.jsonl", [], 2, "cannot write"),
        (tmp_path, [], 2, f"cannot write {tmp_path}: Is a directory"),
        (out, ["--database-url", "mysql://u:p@host/db"], 2, "cannot open a mysql database"),
        (out, ["--database-url", "postgresql://u@host:port/db"], 2, "the database URL is not one"),
        (out, ["--database-url", f"sqlite:///{other}"], 2, "holds no trajproxy tables"),
        (out, ["--status", "finshed"], 2, "invalid choice: 'finshed'"),
    ):
        done = run_export(url, target, *flags)
        last = done.stderr.strip().splitlines()[-1]  # argparse says its usage first
        assert (done.returncode, said in last, "Traceback" in done.stderr) == (status, True, False), done.stderr
        assert not out.exists(), flags
    assert run_export(url, out, "--status", "finished").returncode == 0 and out.read_text().count("\n") == 1


def test_a_database_an_older_trajproxy_wrote_is_refused_until_it_is_upgraded(database_url: str, tmp_path: Path) -> None:
    """The columns the export reads are not there until a newer trajproxy opens the database to serve it."""
    recorded_by_previous(database_url, tmp_path)
    done = run_export(database_url, tmp_path / "out.jsonl")
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "written by an older trajproxy: start `trajproxy serve` on it once to upgrade it" in done.stderr
    assert not (tmp_path / "out.jsonl").exists()

    async def upgrade() -> None:
        store = SqlStore(database_url)
        await store.open()
        await store.close()

    asyncio.run(upgrade())
    assert lines_of(database_url, tmp_path, "--shape", "tokens")


def test_where_tells_true_from_1_as_the_web_page_does(tmp_path: Path) -> None:
    """Python's True == 1 and False == 0; JSON's `true` is not `1`."""
    url = f"sqlite:///{tmp_path}/trajproxy.db"
    values = [1, True, 0, False, 1.5]
    seed(url, len(values), 1, lambda e: {"flag": values[e]})
    for value in values:
        lines = lines_of(url, tmp_path, "--where", f"flag={json.dumps(value)}")
        assert [json.loads(line["metadata"])["flag"] for line in lines] == [value], value
        assert [type(json.loads(line["metadata"])["flag"]) for line in lines] == [type(value)], value


def test_a_reader_that_stops_early_ends_the_export_quietly(tmp_path: Path) -> None:
    """`trajproxy export - | head`: the pipe closes before the export is written; no traceback."""
    url = f"sqlite:///{tmp_path}/trajproxy.db"
    seed(url, 100, 3)  # more than a pipe's buffer
    command = [trajproxy_script(), "export", "-", "--database-url", url, "--quiet"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env()) as export:
        assert export.stdout is not None and export.stderr is not None
        assert export.stdout.read(10) == b'{"messages'
        export.stdout.close()
        said = export.stderr.read().decode()
        assert export.wait(timeout=60) == 1
    assert said == ""


# Flat memory


def seed(
    url: str, episodes: int, turns_per_episode: int, metadata: Callable[[int], dict[str, Any]] = lambda e: {"e": e}
) -> None:
    """Episodes of answered turns with growing conversations, written straight through the store."""

    async def write() -> None:
        store = SqlStore(url)
        await store.open()
        writes = []
        for e in range(episodes):
            episode = Episode(new_id("ep"), hash_key(new_key()), "t", metadata(e), EpisodeStatus.FINISHED, float(e))
            writes.append(store.add_episode(episode))
            messages: list[Any] = [SYSTEM]
            prompt: tuple[int, ...] = (0,)
            for seq in range(turns_per_episode):
                messages = [*messages, {"role": "user", "content": f"step {seq} " + "x" * 200}]
                reply = Reply({"role": "assistant", "content": "y" * 200}, "stop",
                              prompt_token_ids=prompt, completion_token_ids=(1, 2, 3))  # fmt: skip
                writes.append(store.add_turn(Turn(new_id("tu"), episode.id, seq, "chat", {"messages": messages}, b"{}",
                                                  False, TurnStatus.ANSWERED, float(e), reply=reply)))  # fmt: skip
                messages.append(reply.message)
                prompt = (
                    *prompt,
                    1,
                    2,
                    3,
                    *range(50),
                )  # the next call's prompt extends this one
        await asyncio.gather(*writes)
        await store.close()

    asyncio.run(write())


class Sink(io.BytesIO):
    """The export's output, which keeps what happened in order: an episode read (`read`), a line written (`line`)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def write(self, data: ReadableBuffer) -> int:
        self.events.append("line")
        return super().write(data)

    def read_episodes(self, episodes: int) -> None:
        self.events += ["read"] * episodes


@pytest.mark.parametrize("shape", ["chat", "tokens"])
def test_export_writes_each_episode_before_it_reads_the_next(tmp_path: Path, shape: str) -> None:
    """Memory stays flat however many turns there are: an episode's line goes out as soon as it is read, and only
    then is the next read, across pages of episodes (what happened, in order; not how much memory it took)."""
    url = f"sqlite:///{tmp_path}/trajproxy.db"
    seed(url, 450, 5)  # more than two pages of episodes
    sink, engine = Sink(), source(url)
    try:
        counts = export(engine, sink, cast(Shape, shape), Filters(), on_progress=sink.read_episodes)
    finally:
        engine.dispose()
    assert (counts.episodes, counts.lines, counts.turns) == (450, 450, 2250)
    assert sink.events == ["read", "line"] * 450
    assert len(sink.getvalue().splitlines()) == 450


CODEX_TOOLS = [
    {"type": "function", "name": "shell", "parameters": {"type": "object"}},
    {"type": "namespace", "name": "mcp", "tools": []},
    {"type": "web_search"},
]


def test_chat_shape_keeps_codex_roles_and_tools_unless_asked_for_template_shape(
    server: Any, trainer: TrainerClient, background: Any, tmp_path: Path
) -> None:
    episode = trainer.create_episode(task="codex")
    developer = {"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]}
    body = {"model": "m", "input": [developer, {"role": "user", "content": "hi"}], "tools": CODEX_TOOLS}
    with agent_for(episode) as agent:
        call = background(agent.responses.create, **body)
        [parked] = trainer.next_turns(episode=episode.id, wait_s=5)
        trainer.reply(parked.id, message={"content": "hello"})
        call.result(timeout=10)
    trainer.finish(episode.id)
    url = server.settings.database_url

    [kept] = lines_of(url, tmp_path)
    assert [m["role"] for m in kept["messages"]] == ["developer", "user", "assistant"]
    assert [tool["type"] for tool in json.loads(kept["tools"])] == ["function", "namespace", "web_search"]
    [shaped] = lines_of(url, tmp_path, "--for-templates")
    assert [m["role"] for m in shaped["messages"]] == ["system", "user", "assistant"]
    assert shaped["messages"][0]["content"] == "be brief"
    assert [tool["function"]["name"] for tool in json.loads(shaped["tools"])] == ["shell"]
    refused = run_export(url, tmp_path / "t.jsonl", "--shape", "tokens", "--for-templates")
    assert refused.returncode == 2 and "--for-templates" in refused.stderr


def test_split_reward_shares_an_episodes_reward_over_its_trainable_branches(
    recorded: dict[str, Any], tmp_path: Path
) -> None:
    """slime's fan-out: `--split-reward` gives each of an episode's K trainable lines reward / K (the good episode:
    its main branch and its compacted one), and every line carries the episode's stable `rollout_id`."""
    for shape in ("chat", "tokens"):
        whole = lines_of(recorded["url"], tmp_path, "--shape", shape)
        split = lines_of(recorded["url"], tmp_path, "--shape", shape, "--split-reward")
        assert [line["reward"] for line in whole if line["episode_id"] == recorded["good"]] == [1.0, 1.0]
        assert [(line["reward"], line["reward_split_over"]) for line in split] == [
            (0.5, 2),
            (0.5, 2),
            *([(0.0, 1), (None, 1)] if shape == "chat" else []),
        ]
        assert [line["rewards"] for line in split][:2] == [{"reward": 1.0, "style": 0.5}] * 2  # named: whole
        ids = {line["episode_id"]: line["rollout_id"] for line in split}
        assert [line["rollout_id"] for line in whole] == [line["rollout_id"] for line in split]  # stable
        assert len(set(ids.values())) == len(ids) and all(isinstance(i, int) and 0 <= i < 2**63 for i in ids.values())
    refused = run_export(recorded["url"], tmp_path / "a.jsonl", "--shape", "atif", "--split-reward")
    assert refused.returncode == 2 and "--split-reward splits the chat and tokens shapes" in refused.stderr
