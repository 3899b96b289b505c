"""A longer fuzz run than CI's: tests/test_fuzz.py with more cases, on a seed it picks (or is given) and prints,
so whatever it finds can be run again.

    python benchmarks/fuzz.py [--examples 200] [--seed S] [-k EXPR] [--database-url postgresql+psycopg://...]

CI runs those tests on a fixed seed, so it fails only for a change in the code. Here each fuzz test draws
--examples cases (per operation of the trainer API, per agent endpoint and kind of input) from a new seed each
run. With --database-url (or TRAJPROXY_TEST_POSTGRES_URL set) the Postgres half runs too. Prints the seed, each
failing test with the case it failed on, and a summary line; exits 1 if anything failed. pytest's whole output
is kept in a log file whose path is printed.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What names a failing case in a failure's text: hypothesis's falsifying example, and schemathesis's report of
# the operation (the trainer test lists each failing one as "POST /api/...:"), its check and its request.
CASE_LINE = re.compile(
    r"Falsifying example|Failing test case|reproduce_failure|^(GET|POST) /api/\S+:$|- ST\d+ |Invalid component|"
    r"^- (query|body|path)|curl -X|^\w+Error: "
)
LINES_PER_FAILURE = 30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=200, help="cases per fuzz test (CI: 12 to 100)")
    parser.add_argument("--seed", type=int, default=None, help="the seed to run on (default: a new one)")
    parser.add_argument("-k", dest="select", default=None, help="pytest -k expression, to run some tests only")
    parser.add_argument("--database-url", default=os.environ.get("TRAJPROXY_TEST_POSTGRES_URL"))
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"fuzz: seed {seed}, {args.examples} examples per test, Postgres {'on' if args.database_url else 'off'}")
    print(f"again: python benchmarks/fuzz.py --seed {seed} --examples {args.examples}", flush=True)

    folder = Path(tempfile.mkdtemp(prefix="trajproxy-fuzz-"))
    report, log = folder / "junit.xml", folder / "pytest.log"
    env = {**os.environ, "TRAJPROXY_FUZZ_SEED": str(seed), "TRAJPROXY_FUZZ_EXAMPLES": str(args.examples)}
    if args.database_url:
        env["TRAJPROXY_TEST_POSTGRES_URL"] = args.database_url
    command = [sys.executable, "-m", "pytest", "tests/test_fuzz.py", "-q", "--tb=short", f"--junitxml={report}"]
    # No per-test time limit: a run this long outlasts CI's, and every request it makes has its own timeout.
    command += ["-p", "no:cacheprovider", "-p", "no:timeout"]
    command += ["-W", "ignore::pytest.PytestUnknownMarkWarning", "-W", "ignore::pytest.PytestConfigWarning"]
    if args.select:
        command += ["-k", args.select]
    started = time.monotonic()
    with log.open("w") as out:
        subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    minutes = (time.monotonic() - started) / 60

    failures, counts = read_report(report)
    for name, text in failures:
        print(f"\nFAILED {name}")
        for line in case_lines(text):
            print(f"  {line}")
    summary = ", ".join(f"{count} {what}" for what, count in counts.items() if count)
    print(f"\nfuzz: seed {seed}, {args.examples} examples per test: {summary or 'nothing ran'} in {minutes:.1f} min")
    print(f"pytest's output: {log}")
    return 1 if failures or not counts["passed"] else 0


def read_report(report: Path) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Each failed or erred test with its failure's text, and how many tests passed, failed, erred or skipped."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    if not report.exists():
        return [("pytest", "pytest wrote no report: see its output")], counts
    failures = []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            failures.append((name, (problem.get("message") or "") + "\n" + (problem.text or "")))
            counts["failed" if problem.tag == "failure" else "errors"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return failures, counts


def case_lines(text: str) -> list[str]:
    """The lines of a failure that name what failed and on which case (each once, cut to a readable length);
    hypothesis's failing example whole, up to its closing parenthesis."""
    lines = [re.sub(r"^(E\s+|\|\s+)+", "", line.strip()) for line in text.splitlines()]
    found: list[str] = []
    example = False
    for line in lines:
        example = example or line.startswith(("Falsifying example", "Failing test case"))
        if example or (CASE_LINE.search(line) and not line.startswith("assert ")):
            found.append(line)
        example = example and line != ")"
    shown = list(dict.fromkeys(found)) or lines[-LINES_PER_FAILURE:]
    return [line if len(line) <= 400 else line[:400] + " …" for line in shown[:LINES_PER_FAILURE]]


if __name__ == "__main__":
    sys.exit(main())
