"""Harbor task directories (the format of Terminal-Bench 2 and the Harbor registry's datasets).

    my-task/
      instruction.md        what the agent is asked
      task.toml             [agent] / [verifier] timeout_sec, [environment] cpus, memory_mb, docker_image, ...
                            (and trajproxy's own [environment] read_only = true)
      environment/          the build context of the task's image (its Dockerfile)
      tests/test.sh         the verifier: copied in only after the agent has stopped, never visible to it
      solution/solve.sh     the reference solution, run by `--agent oracle`

The verifier writes the reward: a float in /logs/verifier/reward.txt, or named floats in reward.json.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox.backends.images import context_tag
from sandbox.backends.interface import ExecResult, Limits, Sandbox, SandboxError
from sandbox.tasks.task import Grade, Task, TaskError, read_only, tail

TESTS = "/tests"
SOLUTION = "/solution"
LOGS = "/logs"
VERIFIER_LOGS = f"{LOGS}/verifier"
KNOWN = {
    "agent": {"timeout_sec", "user"},
    "verifier": {"timeout_sec", "env", "user"},
    "environment": {"build_timeout_sec", "docker_image", "cpus", "memory_mb", "memory", "read_only"},
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
_MB = {"": 1 / 1024**2, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2}


@dataclass(frozen=True, slots=True)
class Verifier:
    """Copies the task's tests/ to /tests and runs /tests/test.sh; the reward is what it writes to
    /logs/verifier/reward.txt (one float) or reward.json (named floats)."""

    tests: Path
    env: Mapping[str, str] = field(default_factory=dict)
    user: str = "root"  # as Harbor runs it, unless [verifier] user says otherwise

    async def grade(self, box: Sandbox, timeout_s: float) -> Grade:
        await box.upload_tree(TESTS, self.tests)
        command = f"mkdir -p {VERIFIER_LOGS} {LOGS}/agent && bash {TESTS}/test.sh"
        ran = await box.exec(command, timeout_s=timeout_s, env=self.env, user=self.user)
        info: dict[str, Any] = {"exit_code": ran.exit_code, "output": tail(ran.output)}
        if ran.timed_out:
            return Grade({"reward": 0.0}, f"the verifier ran past {timeout_s:g} s", info)
        try:
            rewards, source = await _rewards(box)
        except ValueError as e:
            return Grade({"reward": 0.0}, str(e), info)
        verdict = ", ".join(f"{name} {value:g}" for name, value in rewards.items())
        return Grade(rewards, f"the verifier wrote {verdict} ({source})", {**info, "source": source})


@dataclass(frozen=True, slots=True)
class Solution:
    """The task's solution/ folder, copied to /solution and run as the agent would be: `bash solve.sh`."""

    folder: Path
    user: str = ""  # [agent] user, else the image's

    async def solve(self, box: Sandbox, timeout_s: float) -> ExecResult:
        await box.upload_tree(SOLUTION, self.folder)
        return await box.exec(f"bash {SOLUTION}/solve.sh", timeout_s=timeout_s, user=self.user)


def read(path: Path, *, image: str | None = None) -> Iterator[Task | TaskError]:
    """One task directory, or every task directory in a folder (in name order)."""
    if not path.is_dir():
        yield TaskError(f"{path}: not a directory of Harbor tasks")
        return
    if _is_task(path):
        folders = [path]
    else:
        folders = sorted(child for child in path.iterdir() if child.is_dir() and _is_task(child))
        if not folders:
            yield TaskError(f"{path}: no Harbor task here (a task directory has instruction.md and task.toml)")
    for folder in folders:
        try:
            yield parse(folder, image=image)
        except TaskError as e:
            yield e


def parse(folder: Path, *, image: str | None = None) -> Task:
    """The task in `folder`; `image` runs it in that image instead of building its environment."""
    name = folder.name
    config = _config(folder)
    instruction = folder / "instruction.md"
    if not instruction.is_file() or not instruction.read_text(encoding="utf-8").strip():
        raise TaskError(f"task {name}: needs a non-empty instruction.md")
    tests = folder / "tests"
    if not (tests / "test.sh").is_file():
        raise TaskError(f"task {name}: needs tests/test.sh, the verifier")
    environment = _table(config, "environment", name)
    agent = _table(config, "agent", name)
    verifier = _table(config, "verifier", name)
    build = None
    if image is None:
        image = environment.get("docker_image")
        if image is not None and not isinstance(image, str):
            raise TaskError(f"task {name}: environment.docker_image must be a string")
        if image is None:
            build = folder / "environment"
            if not (build / "Dockerfile").is_file():
                raise TaskError(f"task {name}: needs environment/Dockerfile (or environment.docker_image)")
            image = context_tag(name, build)
    solution = folder / "solution"
    return Task(
        instruction.read_text(encoding="utf-8"),
        image,
        None,  # the image's own working directory, as the task's Dockerfile set it
        Verifier(
            tests,
            _strings(verifier.get("env", {}), f"task {name}: verifier.env"),
            _user(verifier, "root", f"task {name}: verifier.user"),
        ),
        metadata={"format": "harbor", "task": name, "harbor": _unknown(config)},
        id=name,
        grading="in-place",
        build=build,
        build_timeout_s=_seconds(environment, "build_timeout_sec", name) or 600.0,
        solver=Solution(solution, _user(agent, "", f"task {name}: agent.user"))
        if (solution / "solve.sh").is_file()
        else None,
        limits=_limits(environment, name),
        agent_timeout_s=_seconds(agent, "timeout_sec", name),
        grade_timeout_s=_seconds(verifier, "timeout_sec", name),
        read_only=read_only(environment.get("read_only", False), f"task {name}: environment.read_only"),
        scratch=(LOGS, TESTS, SOLUTION),  # where the verifier and the oracle are copied in, and write
    )


async def _rewards(box: Sandbox) -> tuple[dict[str, float], str]:
    """The verifier's reward file, read; ValueError saying what is wrong with it, or that there is none."""
    try:
        text = (await box.download(f"{VERIFIER_LOGS}/reward.txt")).decode("utf-8", "replace").strip()
    except SandboxError:
        text = None
    if text is not None:
        return {"reward": _number(text, "reward.txt")}, "reward.txt"
    try:
        raw = (await box.download(f"{VERIFIER_LOGS}/reward.json")).decode("utf-8", "replace")
    except SandboxError:
        raise ValueError(f"the verifier wrote no reward ({VERIFIER_LOGS}/reward.txt or reward.json)") from None
    try:
        named = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"reward.json is not valid JSON ({e.msg})") from None
    if not isinstance(named, dict) or not named:
        raise ValueError('reward.json must be an object of named rewards, e.g. {"tests": 1.0}')
    return {str(key): _number(value, f"reward.json's {key!r}") for key, value in named.items()}, "reward.json"


def _number(value: Any, where: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} holds {str(value)[:80]!r}, not a number") from None
    if isinstance(value, bool) or not math.isfinite(number):
        raise ValueError(f"{where} holds {value!r}, not a finite number")
    return number


def _is_task(folder: Path) -> bool:
    return (folder / "task.toml").is_file() or (folder / "instruction.md").is_file()


def _config(folder: Path) -> dict[str, Any]:
    path = folder / "task.toml"
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"task {folder.name}: task.toml is not valid TOML ({e})") from None


def _table(config: dict[str, Any], key: str, name: str) -> dict[str, Any]:
    table = config.get(key, {})
    if not isinstance(table, dict):
        raise TaskError(f"task {name}: [{key}] in task.toml must be a table")
    return table


def _unknown(config: dict[str, Any]) -> dict[str, Any]:
    """What trajproxy does not act on, kept as the episode's metadata: [metadata], version, and every other key."""
    kept: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and key in KNOWN:
            rest = {name: item for name, item in value.items() if name not in KNOWN[key]}
            if rest:
                kept[key] = rest
        else:
            kept[key] = value
    plain: dict[str, Any] = json.loads(json.dumps(kept, default=str))  # TOML dates become strings
    return plain


def _seconds(table: dict[str, Any], key: str, name: str) -> float | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise TaskError(f"task {name}: {key} must be a positive number of seconds, not {value!r}")
    return float(value)


def _limits(environment: dict[str, Any], name: str) -> Limits | None:
    cpus, memory_mb = environment.get("cpus"), environment.get("memory_mb")
    if memory_mb is None and (memory := environment.get("memory")) is not None:
        size = _SIZE.match(str(memory))
        if size is None:
            raise TaskError(f"task {name}: environment.memory {memory!r} is not a size like '2G' or '512M'")
        memory_mb = float(size.group(1)) * _MB[size.group(2).upper()]
    if cpus is None and memory_mb is None:
        return None
    for key, value in (("cpus", cpus), ("memory_mb", memory_mb)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
            raise TaskError(f"task {name}: environment.{key} must be a positive number, not {value!r}")
    default = Limits()
    return Limits(
        cpus=float(cpus) if cpus is not None else default.cpus,
        memory_bytes=int(memory_mb * 1024**2) if memory_mb is not None else default.memory_bytes,
    )


def _user(table: dict[str, Any], default: str, where: str) -> str:
    user = table.get("user", default)
    if not isinstance(user, str | int) or isinstance(user, bool):
        raise TaskError(f"{where} must be a user name or id")
    return str(user)


def _strings(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(item, str | int | float) for item in value.values()):
        raise TaskError(f"{where} must be a table of strings")
    return {str(key): str(item) for key, item in value.items()}
