""".ci/lanes.sh, which .ci/run's last stages run side by side with: each stage's output is printed whole, in the
order the stages were started, whichever ended first; a failed stage fails the run by name once all have ended; and
waiting for them leaves the caller's other background processes (mypy, the venvs' build) to the caller."""

from __future__ import annotations

import re
import subprocess

from testkit.tasks import ROOT

PRELUDE = f"""set -euo pipefail
stage() {{ echo "stage: $1" >&2; }}
source {ROOT / ".ci" / "lanes.sh"}
"""


def run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", PRELUDE + script], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_each_stages_output_is_whole_and_in_order_and_a_failure_fails_the_run_by_name() -> None:
    done = run(
        """
        (sleep 1; exit 7) & other=$!
        alongside "slow" sh -c 'echo slow-1; sleep 1; echo slow-2'
        alongside "fails" sh -c 'echo fails-out; echo fails-err >&2; exit 3'
        alongside "quoted" sh -c 'echo "[$0] [$1]"' "a b" "c  d"
        together "side by side"
        echo "not reached"
        """
    )
    assert done.returncode == 1, done
    assert done.stdout.splitlines() == ["slow-1", "slow-2", "fails-out", "fails-err", "[a b] [c  d]"]
    assert "not reached" not in done.stdout
    lines = done.stderr.splitlines()
    assert [line.split(" took ")[0] for line in lines if line.startswith(".ci/run: ") and " took " in line] == [
        ".ci/run: slow",
        ".ci/run: fails",
        ".ci/run: quoted",
    ]
    assert any(re.fullmatch(r"\.ci/run: fails took \d+ s \(side by side\), exit status 3", line) for line in lines)
    assert lines[-2:] == ["stage: side by side", ".ci/run: failed: fails"]


def test_stages_that_pass_end_the_stage_and_leave_the_callers_other_processes_to_it() -> None:
    done = run(
        """
        (sleep 1; exit 7) & other=$!
        alongside "one" true
        together "first"
        alongside "two" sh -c 'echo two'
        together "second"
        wait "$other" || echo "the other process exited $?"
        """
    )
    assert done.returncode == 0, done
    assert done.stdout.splitlines() == ["two", "the other process exited 7"]
    assert "stage: first" in done.stderr and "stage: second" in done.stderr and "failed" not in done.stderr
