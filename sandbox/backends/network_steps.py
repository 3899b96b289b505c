"""`RUN --network=none` where the engine's builder lacks it (Docker's classic builder, the one the docker SDK drives):
the Dockerfile cut where a step's network changes, each part built from the last with the network its steps ask for."""

from __future__ import annotations

import contextlib
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.backends.interface import SandboxError

_NETWORK_FLAG = re.compile(r"^(\s*RUN\s+)--network=(\S+)\s+", re.IGNORECASE)
_NETWORKS: dict[str, str | None] = {"default": None, "none": "none"}  # BuildKit's name -> the builder's network_mode


@dataclass(frozen=True, slots=True)
class Part:
    dockerfile: str  # a later part's text goes after `FROM <the last part's image>`
    network: str | None  # the builder's network_mode for its steps: None for the engine's default


def parts(dockerfile: str) -> list[Part]:
    """The Dockerfile as parts that build one from another; one part, as it is, when no step names a network.
    SandboxError for what the cut cannot keep: several stages, ONBUILD, another escape character, a network other
    than `none` or `default`."""
    steps = _instructions(dockerfile)
    flagged = [step for step in steps if _NETWORK_FLAG.match(step)]
    if not flagged:
        return [Part(dockerfile, None)]
    words = [_word(step) for step in steps]
    if words.count("FROM") != 1 or "ONBUILD" in words or re.match(r"#\s*escape\s*=", dockerfile.lstrip()):
        raise SandboxError(
            "this Dockerfile's RUN --network needs BuildKit (Dockerfile 1.3 or later), which this engine lacks; "
            "the classic builder takes it in a single stage with no ONBUILD and the default escape character"
        )
    found: list[Part] = []
    current: list[str] = []
    carried: list[str] = []  # a stage's ARGs: a later part redeclares them, as its FROM forgets them
    network: str | None = None
    for step, word in zip(steps, words, strict=True):
        if word == "RUN":
            wanted, step = _network(step)
            if wanted != network and any(_word(line) == "RUN" for line in current):
                found.append(Part("\n".join(current) + "\n", network))
                current = list(carried)
            network = wanted
        elif word == "ARG" and (found or "FROM" in map(_word, current)):
            carried.append(step)
        current.append(step)
    found.append(Part("\n".join(current) + "\n", network))
    return found


def build_parts(
    client: Any, context: Path, chain: list[Part], tag: str, timeout_s: float, labels: dict[str, str]
) -> None:
    """Each part built from the last in `context`, the last tagged `tag`; the parts already built are removed when a
    later one fails (each one's steps stay in the engine's cache while an image uses them)."""
    built: list[str] = []
    try:
        for index, part in enumerate(chain):
            text = part.dockerfile if not built else f"FROM {built[-1]}\n{part.dockerfile}"
            with tempfile.TemporaryDirectory(prefix="trajproxy-part-") as folder:
                dockerfile = Path(folder) / "Dockerfile"  # outside the context: the SDK sends it, COPY never sees it
                dockerfile.write_text(text, encoding="utf-8")
                image, _ = client.images.build(
                    path=str(context),
                    dockerfile=str(dockerfile),
                    tag=tag if index == len(chain) - 1 else None,
                    rm=True,
                    forcerm=True,
                    timeout=timeout_s,
                    labels=labels,
                    network_mode=part.network,
                )
            built.append(image.id)
    except BaseException:
        for image_id in reversed(built):
            with contextlib.suppress(Exception):  # in use by another image: the engine keeps it, as it should
                client.images.remove(image_id)
        raise


def _instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's instructions, each with its continuation lines; comments and blank lines left out."""
    steps: list[str] = []
    pending: list[str] = []
    for line in dockerfile.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending.append(line)
        if not line.rstrip().endswith("\\"):
            steps.append("\n".join(pending))
            pending = []
    if pending:
        steps.append("\n".join(pending))
    return steps


def _word(step: str) -> str:
    return step.split(maxsplit=1)[0].upper()


def _network(step: str) -> tuple[str | None, str]:
    """A RUN step's network and the step without the flag."""
    flag = _NETWORK_FLAG.match(step)
    if flag is None:
        return None, step
    if flag.group(2).lower() not in _NETWORKS:
        raise SandboxError(f"RUN --network={flag.group(2)}: only `none` and `default` are supported")
    return _NETWORKS[flag.group(2).lower()], flag.group(1) + step[flag.end() :]
