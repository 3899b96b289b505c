"""The command line of the sandbox side: the options of `trajproxy run`, `trajproxy agents`, `trajproxy sandbox
prune` and `trajproxy tasks make`. What each does is `sandbox.commands`, loaded only when one runs: `trajproxy
--help` and `trajproxy serve` build this parser and import no more than it needs."""

from __future__ import annotations

import argparse

from sandbox.agents.manifests import PLACEHOLDERS, presets
from sandbox.tasks.task import FORMATS, GRADING_MODES


class _WithDefaults(argparse.HelpFormatter):
    """Help that shows each option's default, unless it has none or its help says it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, [], False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


# What runs each command, named as an entry point is and loaded only when one runs (`proxy.cli.main` resolves it):
# `trajproxy --help` and `trajproxy serve` build this parser and never import what the commands use (httpx, the
# Docker SDK, Rich).
RUN = "sandbox.commands:main"
BUNDLES_HELP = "the bundles' folder (default: $TRAJPROXY_BUNDLES, else ~/.cache/trajproxy/bundles)"


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    placeholders = "; ".join(f"{{{name}}}: {what}" for name, what in PLACEHOLDERS.items()).replace("%", "%%")
    run = commands.add_parser(
        "run",
        help="run tasks (a JSONL file, Harbor task directories, SWE-bench instances) in sandboxes and grade them",
        description="Run an agent on each task in its own container of the task's image, grade its work (in a fresh "
        "container with its diff applied, or in place once it has stopped), record the reward. The agent's bundle "
        f"is mounted read-only into the task's container (built on first use). Placeholders in a manifest: "
        f"{placeholders}.",
        formatter_class=_WithDefaults,
    )
    run.add_argument(
        "tasks",
        help="a JSONL file (prompt, label, metadata.image/workdir/eval_cmd), a Harbor task directory or a folder "
        "of them, or a file of SWE-bench instances (JSONL or a datasets-loadable .parquet/.json)",
    )
    run.add_argument("--format", choices=FORMATS, help="the tasks' format (default: told by what the path is)")
    run.add_argument("--image", help="run every task in this image instead of its own")
    run.add_argument(
        "--image-template",
        help="SWE-bench: each instance's image, from {instance_id} and {repo} "
        "(default: swebench's own, swebench/sweb.eval.x86_64.<id>:latest)",
    )
    run.add_argument(
        "--grading",
        choices=GRADING_MODES,
        help="fresh: apply the agent's diff in a new container; in-place: grade in the agent's own once it has "
        "stopped (default: the format's: in-place for Harbor, fresh otherwise)",
    )
    agent = run.add_mutually_exclusive_group(required=True)
    agent.add_argument(
        "--agent",
        help=f"a preset ({', '.join(presets())}) or a manifest file (./my-agent.toml), "
        "injected into each task's own image; oracle: run each task's own solution instead (Harbor's "
        "solution/solve.sh, SWE-bench's gold patch), to check a dataset before training on it",
    )
    agent.add_argument(
        "--agent-cmd", help="instead, a command already in the task's image; {task_file} and {workdir} are filled in"
    )
    run.add_argument("--model", help="the model name the agent asks for (default: the manifest's, 'policy')")
    run.add_argument("--bundles", help=BUNDLES_HELP)
    run.add_argument(
        "--policy",
        default="trainer",
        help="trainer (default), scripted:FILE, model:NAME (any litellm model), or vllm:NAME / sglang:NAME (the policy "
        "being trained on its inference server, its token ids recorded; needs --policy-option api_base=URL)",
    )
    run.add_argument(
        "--policy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of a model or served policy (api_base, temperature, max_tokens, seed, …); a value that "
        'reads as JSON is taken so (0.7, 256, true, ["\\n"]); repeat for each',
    )
    run.add_argument("--concurrency", type=int, default=4, help="tasks run at once")
    run.add_argument(
        "--agent-timeout-s", type=float, help="each agent's time limit (default: the task's own, else 1800)"
    )
    run.add_argument("--grade-timeout-s", type=float, help="each grading's time limit (default: the task's, else 600)")
    run.add_argument(
        "--episode-timeout-s",
        type=float,
        help="each episode's deadline, from its sandbox's start to its grade: past it, whatever is stuck (a start, the "
        "agent, the grader) is stopped, its sandbox removed, the episode failed (default: the agent's and grader's "
        "limits plus 300, plus the build's for a task with its own image to build)",
    )
    run.add_argument("--cpus", type=float, help="CPUs per sandbox (default: the task's own, else 1)")
    run.add_argument("--memory-mb", type=int, help="memory per sandbox (default: the task's own, else 2048)")
    run.add_argument("--pids", type=int, default=512, help="processes per sandbox")
    run.add_argument(
        "--read-only",
        action=argparse.BooleanOptionalAction,
        help="the agent's root filesystem read-only, but for the task's working directory (a copy of the image's, on "
        "a volume), /tmp (where the agent's HOME is) and a format's own folders (Harbor's /logs, /tests, /solution); "
        "--no-read-only: writable, whatever a task says (default: each task's own read_only, else writable)",
    )
    run.add_argument(
        "--scratch-mb",
        type=_positive,
        default=1024,
        help="with --read-only: the size of /tmp and each other scratch folder",
    )
    run.add_argument("--proxy-url", help="a running trajproxy's URL (default: run one for this run)")
    run.add_argument(
        "--trainer-token", help="its trainer token (default: TRAJPROXY_TRAINER_TOKEN, or the token file it keeps)"
    )
    run.add_argument(
        "--socket-source",
        help="with --proxy-url: the path of its --socket-path (or the folder or Docker volume holding proxy.sock)",
    )
    run.add_argument("--port", type=int, default=8000, help="the embedded trajproxy's port, for a trainer")
    run.add_argument("--database-url", default="sqlite:///./trajproxy.db", help="the embedded trajproxy's database")
    run.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Docker label for every container of this run (repeatable)",
    )
    batch = run.add_argument_group("batch runs", "for scripts, CI and batch schedulers")
    batch.add_argument(
        "--results",
        metavar="FILE.jsonl",
        help="write one JSON line per task as it ends: task_id, task, episode_id, status, reward, reason, timings "
        "(started afresh; appended to with --resume)",
    )
    batch.add_argument(
        "--resume",
        action="store_true",
        help="skip the tasks this database holds as done already: an episode of the task (by task id) finished, "
        "or failed with a reward; cancelled ones, and failed ones with no reward, run again",
    )
    batch.add_argument(
        "--progress-every-s",
        type=float,
        default=30.0,
        help="off a terminal (a CI log, a batch job's file), print a progress line this often",
    )
    batch.add_argument(
        "--keep-serving",
        action="store_true",
        help="after the last task, keep the embedded trajproxy up for a trainer to read what it recorded, "
        "until Ctrl-C or SIGTERM",
    )
    cluster = run.add_argument_group("cluster", "spread the run's sandboxes over the nodes of a Ray cluster")
    cluster.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        metavar="ADDRESS",
        help="run each task's sandboxes on a node of this Ray cluster (default: the one `ray start` made here) that "
        "declares the resource trajproxy_sandboxes (how many at once); each such node serves a trajproxy replica for "
        "its sandboxes, all on --database-url, which must be Postgres (needs pip install 'trajproxy[ray]')",
    )
    fork = run.add_argument_group(
        "forks", "run the task of a recorded episode again, each run replaying the episode's first K calls"
    )
    fork.add_argument(
        "--fork",
        type=fork_spec,
        metavar="EPISODE@K",
        help="fork this episode (in --database-url, or the --proxy-url's) at call K: its task is found in TASKS by "
        "the episode's task_id; the policy answers from call K on",
    )
    fork.add_argument("-n", "--forks", type=int, default=1, help="how many forks")
    fork.add_argument(
        "--fork-ignore", action="append", default=[], metavar="FIELD", help="a field name a replayed call may differ in"
    )
    fork.add_argument("--fork-min-similarity", type=float, help="replay calls at least this similar (0 to 1)")
    fork.add_argument(
        "--on-divergence",
        choices=["policy", "fail"],
        default="policy",
        help="a call that differs: to the policy, or fail",
    )
    run.set_defaults(handler=RUN)
    agents = commands.add_parser("agents", help="build and list agent bundles")
    actions = agents.add_subparsers(dest="action", required=True, metavar="{build,list}")
    build = actions.add_parser(
        "build",
        help="build each agent's bundle",
        description="Build each agent's bundle (its pinned packages and the runtime it carries), once: an unchanged "
        "manifest finds the bundle it built before.",
    )
    build.add_argument("names", nargs="+", metavar="AGENT", help="presets or manifest files (./my-agent.toml)")
    build.add_argument("--force", action="store_true", help="build again even if the bundle is there")
    listing = actions.add_parser(
        "list",
        help="show the agents, what each runs on and its bundle",
        description="Show each agent (every preset, then the bundles of no preset; or only the AGENTs given): its "
        "version, what it runs on (the Python or Node its bundle carries, or native: its own binaries) and its "
        "bundle, if built.",
    )
    listing.add_argument("names", nargs="*", metavar="AGENT", help="presets or manifest files (default: all)")
    for action in (build, listing):
        action.add_argument("--bundles", help=BUNDLES_HELP)
        action.set_defaults(handler=RUN)
    sandbox = commands.add_parser("sandbox", help="manage sandboxes")
    sandbox.set_defaults(handler=RUN)
    sandbox.add_argument(
        "action",
        choices=["prune"],
        help="prune: remove the containers of your trajproxy runs that are gone (a crash, a kill); "
        "a live run's, another user's and another host's are left",
    )
    sandbox.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE", help="only containers with this label (repeatable)"
    )
    _taskmaker_commands(commands)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number above 0")
    return int(text)


def fork_spec(text: str) -> tuple[str, int]:
    """EPISODE@K, as --fork takes it."""
    episode, at, turn = text.rpartition("@")
    if not at or not episode or not turn.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected EPISODE@K, e.g. ep_1a2b3c@4")
    return episode, int(turn)


def _taskmaker_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tasks = commands.add_parser("tasks", help="make training tasks from a repository")
    actions = tasks.add_subparsers(dest="action", required=True)
    make = actions.add_parser(
        "make",
        help="Harbor tasks from a Python project's own tests, by injected bugs",
        description="Build the project with its test dependencies, run its tests twice (the flaky ones are left out), "
        "inject bugs where the passing tests look (operators, comparisons, off-by-ones, constants, dropped lines "
        "and branches, swapped arguments), keep those that make some tests fail and leave the rest passing, and "
        "write each as a Harbor task that `trajproxy run DIR` runs; every task is checked with the oracle "
        "(reward 1) and an agent that changes nothing (reward 0).",
    )
    make.add_argument("source", help="a Python project: a folder, a git repository, or an sdist/archive")
    make.add_argument("--out", required=True, help="the folder to write the tasks to (new or empty)")
    make.add_argument("--max", type=int, default=10, help="at most this many tasks (default: 10)")
    make.add_argument("--seed", type=int, default=0, help="the seed that orders candidate bugs (default: 0)")
    make.add_argument("--concurrency", type=int, default=2, help="tasks validated at once (default: 2)")
    make.set_defaults(handler=RUN)
