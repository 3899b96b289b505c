"""slime's JSONL: `prompt`, `label`, and `metadata` with `image`, `workdir` and `eval_cmd`, whose exit code grades
the work (1.0 when it exits 0).

slime's SWE-bench-style rows are taken as they are: where `metadata` lacks `eval_cmd`, `image`, `workdir` or
`instance_id`, its `remote_env_info` gives them (`f2p_script`, `image_url`, `workdir`, `instance_id`), as slime's
coding-agent example reads them; `pre_commands` (in either) run before the agent and before the grade."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.backends.interface import Sandbox
from sandbox.tasks.task import Grade, Grader, Task, TaskError, read_only, tail

F2P_FILE = "/tmp/trajproxy-f2p.py"


@dataclass(frozen=True, slots=True)
class ExitCode:
    """Runs `command`; the reward is 1.0 when it exits 0, else 0.0."""

    command: str

    async def grade(self, box: Sandbox, timeout_s: float) -> Grade:
        result = await box.exec(self.command, timeout_s=timeout_s)
        if result.timed_out:
            verdict = f"the grader ran past {timeout_s:g} s"
        else:
            verdict = "tests pass" if result.ok else f"tests fail (exit {result.exit_code})"
        info = {"exit_code": result.exit_code, "output": tail(result.output)}
        return Grade({"reward": 1.0 if result.ok else 0.0}, verdict, info)


@dataclass(frozen=True, slots=True)
class PythonScript:
    """slime's `f2p_script`: a self-contained Python file (its tests, ending in `sys.exit(pytest.main(...))`), written
    to a file in the sandbox as it is (no shell quoting to get wrong) and run there with the image's Python in the
    working directory; as with `eval_cmd`, the reward is 1.0 when it exits 0."""

    script: str

    async def grade(self, box: Sandbox, timeout_s: float) -> Grade:
        await box.upload(F2P_FILE, self.script.encode())
        python = f"if command -v python >/dev/null; then python {F2P_FILE}; else python3 {F2P_FILE}; fi"
        return await ExitCode(python).grade(box, timeout_s)


def parse(data: Any, *, line: int = 0, image: str | None = None) -> Task:
    """A task from one decoded JSONL object; `image` overrides the task's own (e.g. `--image`)."""
    where = f"task on line {line}" if line else "task"
    if not isinstance(data, dict):
        raise TaskError(f"{where}: expected a JSON object, got {type(data).__name__}")
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise TaskError(f"{where}: 'metadata' must be an object")
    remote = metadata.get("remote_env_info") or {}
    if not isinstance(remote, dict):
        raise TaskError(f"{where}: 'metadata.remote_env_info' must be an object")
    prompt = metadata.get("problem_statement") or data.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise TaskError(f"{where}: needs a 'prompt' (or metadata.problem_statement)")
    image = image or metadata.get("image") or remote.get("image_url")
    if not isinstance(image, str) or not image:
        raise TaskError(f"{where}: needs metadata.image (or pass --image)")
    workdir = metadata.get("workdir") or remote.get("workdir") or "/"
    return Task(
        prompt,
        image,
        str(workdir),
        _grader(metadata, remote, where),
        data.get("label"),
        metadata,
        line,
        id=_id_of(data, remote, line),
        read_only=read_only(metadata.get("read_only", False), f"{where}: metadata.read_only"),
        setup=_setup(metadata.get("pre_commands") or remote.get("pre_commands"), where),
    )


def _grader(metadata: dict[str, Any], remote: dict[str, Any], where: str) -> Grader:
    """`eval_cmd`, else `remote_env_info.f2p_script` (slime's order)."""
    eval_cmd, script = metadata.get("eval_cmd"), remote.get("f2p_script")
    if isinstance(eval_cmd, str) and eval_cmd.strip():
        return ExitCode(eval_cmd)
    if isinstance(script, str) and script.strip():
        return PythonScript(script)
    raise TaskError(
        f"{where}: needs metadata.eval_cmd, the command whose exit code grades the work "
        "(or metadata.remote_env_info.f2p_script, a Python file that does)"
    )


def _setup(pre_commands: Any, where: str) -> str:
    """slime's `pre_commands` as one script: a list of commands, or a string whose escaped newlines are lines."""
    if not pre_commands:
        return ""
    if isinstance(pre_commands, str):
        return pre_commands.replace("\\n", "\n")
    if isinstance(pre_commands, list) and all(isinstance(command, str) for command in pre_commands):
        return "\n".join(command for command in pre_commands if command)
    raise TaskError(f"{where}: pre_commands must be a list of commands or a string, not {pre_commands!r:.80}")


def read(path: Path, *, image: str | None = None) -> Iterator[Task | TaskError]:
    """Every line of a JSONL file as a Task, or as the TaskError that says why it cannot run."""
    with open(path, encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                yield parse(json.loads(text), line=number, image=image)
            except json.JSONDecodeError as e:
                yield TaskError(f"task on line {number}: not valid JSON ({e.msg} at column {e.colno})")
            except TaskError as e:
                yield e


def _id_of(data: dict[str, Any], remote: dict[str, Any], line: int) -> str:
    """The task's own `id` (or `metadata.instance_id`, or `remote_env_info`'s); else its line and a digest of its
    content, so a resumed run neither skips an edited task nor takes two equal lines for one."""
    given = data.get("id") or data["metadata"].get("instance_id") or remote.get("instance_id")
    if isinstance(given, str | int) and str(given):
        return str(given)
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]
    return f"line-{line}-{digest}"
