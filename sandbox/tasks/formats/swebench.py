"""SWE-bench instances (JSONL, or any file `datasets` loads), graded the way SWE-bench's own harness grades them.

The `swebench` package supplies what makes the grade SWE-bench's: the eval script for the instance's repository and
version (reset the test files, apply the test patch, run the repository's test command on the files it touches),
the log parser for that repository, and the report that says resolved (every FAIL_TO_PASS test passes, every
PASS_TO_PASS test still passes). trajproxy runs the script in a container of the instance's image and hands the
log to that report. Install it with `pip install 'trajproxy[swebench]'`.
"""

from __future__ import annotations

import functools
import json
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.backends.interface import ExecResult, Sandbox
from sandbox.tasks.task import Grade, Task, TaskError, tail

REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")
# Where swebench's own images are published (namespace "swebench"), as its harness names them.
DEFAULT_IMAGE = "swebench/sweb.eval.x86_64.{instance_id}:latest"
WORKDIR = "/testbed"
EVAL_SCRIPT = "/tmp/trajproxy.eval.sh"
GOLD_PATCH = "/tmp/trajproxy.gold.diff"
_DATASET_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json"}


@dataclass(frozen=True, slots=True)
class SweBenchGrader:
    """Runs swebench's eval script for the instance and grades its log with swebench's parser and report."""

    instance: dict[str, Any]

    async def grade(self, box: Sandbox, timeout_s: float) -> Grade:
        get_eval_report = harness().grading.get_eval_report
        spec = test_spec(self.instance)
        await box.upload(EVAL_SCRIPT, spec.eval_script.encode())
        ran = await box.exec(f"bash {EVAL_SCRIPT}", timeout_s=timeout_s)
        if ran.timed_out:
            return Grade({"reward": 0.0}, f"the tests ran past {timeout_s:g} s", {"output": tail(ran.output)})
        with tempfile.NamedTemporaryFile("w", suffix=".log", encoding="utf-8") as log:
            log.write(ran.output)
            log.flush()
            prediction = {"instance_id": spec.instance_id, "model_patch": "", "model_name_or_path": "trajproxy"}
            report = get_eval_report(spec, prediction, log.name, include_tests_status=True)[spec.instance_id]
        tests = report.get("tests_status", {})
        info = {"resolved": report["resolved"], "tests_status": tests, "output": tail(ran.output)}
        if not report["patch_successfully_applied"]:
            return Grade({"reward": 0.0}, "the tests did not run (the test patch did not apply)", info)
        failing = [name for kind in ("FAIL_TO_PASS", "PASS_TO_PASS") for name in tests.get(kind, {}).get("failure", [])]
        verdict = "resolved" if report["resolved"] else f"not resolved: {len(failing)} test(s) fail"
        return Grade({"reward": 1.0 if report["resolved"] else 0.0}, verdict, info)


@dataclass(frozen=True, slots=True)
class GoldPatch:
    """The instance's own fix (`patch`), applied in place of an agent (`--agent oracle`)."""

    patch: str

    async def solve(self, box: Sandbox, timeout_s: float) -> ExecResult:
        await box.upload(GOLD_PATCH, self.patch.encode())
        return await box.exec(f"git apply --whitespace=nowarn {GOLD_PATCH}", timeout_s=timeout_s)


def test_spec(instance: dict[str, Any]) -> Any:
    """swebench's TestSpec for the instance, with its eval script, made without fetching anything: the environment
    and repository scripts (which only build images) are left empty."""
    swebench = harness()
    repo, version = instance["repo"], instance["version"]
    specs = swebench.constants.MAP_REPO_VERSION_TO_SPECS[repo][version]
    commands = swebench.test_spec.create_scripts.make_eval_script_list(
        instance, specs, "testbed", WORKDIR, instance["base_commit"], instance["test_patch"]
    )
    return swebench.test_spec.test_spec.TestSpec(
        instance_id=instance["instance_id"],
        repo=repo,
        version=version,
        repo_script_list=[],
        eval_script_list=commands,
        env_script_list=[],
        arch="x86_64",
        FAIL_TO_PASS=_names(instance["FAIL_TO_PASS"]),
        PASS_TO_PASS=_names(instance["PASS_TO_PASS"]),
        language=swebench.constants.MAP_REPO_TO_EXT[repo],
        docker_specs={},
        namespace="swebench",
    )


test_spec.__test__ = False  # type: ignore[attr-defined]  # a name pytest would otherwise collect


@functools.cache
def harness() -> Any:
    """swebench's harness package. Importing swebench configures the root logger (INFO, to stderr), which would
    print every HTTP request `trajproxy run` makes: the logging set-up it found is put back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        # lazy: swebench (an optional extra) takes seconds to import; only SWE-bench tasks need it
        import swebench.harness.constants
        import swebench.harness.grading
        import swebench.harness.test_spec.create_scripts
        import swebench.harness.test_spec.test_spec
    finally:
        root.handlers[:], root.level = handlers, level
    return swebench.harness


def looks_like(path: Path) -> bool:
    """Whether a file holds SWE-bench instances: a dataset file, or JSON(L) whose first object has an
    instance_id and a base_commit."""
    if path.suffix in _DATASET_SUFFIXES:
        return True
    try:
        with open(path, encoding="utf-8") as lines:
            first = next((line for line in lines if line.strip()), "")
        data = json.loads(first)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and {"instance_id", "base_commit"} <= data.keys()


def read(path: Path, *, image: str | None = None, image_template: str | None = None) -> Iterator[Task | TaskError]:
    """Every instance in the file as a Task, or the TaskError that says why it cannot run."""
    try:
        harness()  # here, so that a missing package is said once, up front
    except ImportError:
        yield TaskError("SWE-bench instances need the swebench package: pip install 'trajproxy[swebench]'")
        return
    for number, instance in _instances(path):
        if isinstance(instance, TaskError):
            yield instance
            continue
        try:
            yield parse(instance, line=number, image=image, image_template=image_template)
        except TaskError as e:
            yield e


def parse(instance: Any, *, line: int = 0, image: str | None = None, image_template: str | None = None) -> Task:
    specs = harness().constants.MAP_REPO_VERSION_TO_SPECS
    where = f"instance on line {line}" if line else "instance"
    if not isinstance(instance, dict):
        raise TaskError(f"{where}: expected a JSON object, got {type(instance).__name__}")
    where = f"instance {instance.get('instance_id') or f'on line {line}'}"
    missing = [key for key in (*REQUIRED, "version") if not isinstance(instance.get(key), str | list)]
    if missing:
        raise TaskError(f"{where}: needs {', '.join(missing)}")
    repo, version = instance["repo"], str(instance["version"])
    if version not in specs.get(repo, {}):
        raise TaskError(f"{where}: swebench has no test spec for {repo} version {version}")
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        try:
            _names(instance[key])
        except ValueError as e:
            raise TaskError(f"{where}: {key} {e}") from None
    instance = {**instance, "version": version}
    instance_id = instance["instance_id"]
    if image is None:
        given = instance.get("image")
        image = given if isinstance(given, str) and given else None
    if image is None and image_template is not None:
        image = image_template.format(instance_id=instance_id.lower(), repo=repo)
    if image is None:  # the name swebench's harness gives the instance's published image
        image = DEFAULT_IMAGE.format(instance_id=instance_id.lower()).replace("__", "_1776_")
    gold = instance.get("patch")
    return Task(
        instance["problem_statement"],
        image,
        WORKDIR,
        SweBenchGrader(instance),
        metadata={"format": "swebench", "instance_id": instance_id, "repo": repo, "version": version},
        line=line,
        id=instance_id,
        grading="fresh",
        solver=GoldPatch(gold) if isinstance(gold, str) and gold.strip() else None,
    )


def _instances(path: Path) -> Iterator[tuple[int, Any]]:
    """(line or row number, the instance or the TaskError that says why it cannot be read)"""
    if path.suffix in _DATASET_SUFFIXES:
        import datasets  # lazy: datasets (with swebench, an optional extra) is slow to import; only its files need it

        loaded = datasets.load_dataset(_DATASET_SUFFIXES[path.suffix], data_files=str(path), split="train")
        for number, row in enumerate(loaded, start=1):
            yield number, row
        return
    with open(path, encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if text.strip():
                try:
                    yield number, json.loads(text)
                except json.JSONDecodeError as e:
                    yield number, TaskError(f"instance on line {number}: not valid JSON ({e.msg} at column {e.colno})")


def _names(value: Any) -> list[str]:
    """A FAIL_TO_PASS / PASS_TO_PASS list, given as a list or as the JSON text of one (as the datasets hold it)."""
    try:
        names = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        names = None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise ValueError("must be a list of test names (or its JSON text)")
    return names
