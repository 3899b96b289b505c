"""Task images: found on this machine, pulled, or built from a task's own build context under a tag derived from
that context's content, so a task whose environment has not changed is never built twice; one-off containers run
from an image to their end (a bundle build); and the removal of containers, whatever state they are in, and of those
whose run is gone."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors

from sandbox.backends.identity import RunIdentity
from sandbox.backends.interface import ExecResult, SandboxError
from sandbox.backends.network_steps import build_parts, parts

MANAGED = "trajproxy.managed"
BUNDLE_BUILD = {MANAGED: "1", "trajproxy.role": "bundle-build"}
_LOG_KEPT = 3000


def ensure_image(client: Any, image: str) -> None:
    """Use the local image, or pull it; a clear error if neither works (no registry, a typo)."""
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        try:
            client.images.pull(image)
        except docker.errors.DockerException as e:
            raise SandboxError(
                f"image {image!r} not found on this machine and could not be pulled; build it first "
                f"(e.g. docker build -t {image} .) or check its name"
            ) from e


def check_arch(client: Any, image: str, arch: str) -> None:
    """An image whose machine the agent's programs were not built for is refused before anything starts."""
    found = client.images.get(image).attrs.get("Architecture")
    if found and found != arch:
        raise SandboxError(f"the agent bundle is built for {arch}; image {image!r} is {found}: it cannot run there")


def context_tag(name: str, context: Path) -> str:
    """The tag an image built from `context` gets: trajproxy-task/<name>:<digest of every file's path, mode and
    content>."""
    digest = hashlib.sha256()
    for path in sorted(p for p in context.rglob("*") if p.is_file() or p.is_symlink()):
        relative = path.relative_to(context).as_posix()
        digest.update(f"{relative}\0{path.lstat().st_mode & 0o777:o}\0".encode())
        digest.update(str(path.readlink()).encode() if path.is_symlink() else path.read_bytes())
        digest.update(b"\0")
    repository = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip(".-_") or "task"
    return f"trajproxy-task/{repository}:{digest.hexdigest()[:16]}"


def build_image(client: Any, context: Path, tag: str, timeout_s: float) -> bool:
    """Build `tag` from `context` unless it is there already; True when it was built now. A failed build says
    which step failed and how its log ended. `RUN --network=none` holds here as under BuildKit."""
    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        pass
    else:
        return False
    if not (context / "Dockerfile").is_file():
        raise SandboxError(f"no Dockerfile in {context}: a task's environment needs one to build {tag}")
    chain, labels = parts((context / "Dockerfile").read_text(encoding="utf-8", errors="replace")), {MANAGED: "1"}
    try:
        if len(chain) == 1 and chain[0].network is None:
            client.images.build(path=str(context), tag=tag, rm=True, forcerm=True, timeout=timeout_s, labels=labels)
        else:  # RUN --network, which this engine's builder lacks: a part per network
            build_parts(client, context, chain, tag, timeout_s, labels)
    except docker.errors.BuildError as e:
        log = "".join(str(chunk.get("stream", chunk.get("error", ""))) for chunk in e.build_log)
        raise SandboxError(f"building {tag} from {context} failed: {e.msg}\n{log[-_LOG_KEPT:]}") from e
    except docker.errors.DockerException as e:
        raise SandboxError(f"could not build {tag} from {context}: {e}") from e
    return True


def remove_containers(*containers: Any) -> None:
    """Remove the containers (None: none there) and their anonymous volumes, each even if removing another failed."""
    errors = []
    for container in containers:
        if container is None:
            continue
        try:
            container.remove(force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if e.status_code != 409:  # 409: a removal is already under way
                errors.append(f"{container.id[:12]}: {e}")
        except docker.errors.DockerException as e:
            errors.append(f"{container.id[:12]}: {e}")
    if errors:
        raise SandboxError(f"could not remove container(s) {'; '.join(errors)}")


@dataclass(frozen=True, slots=True)
class Pruned:
    """What a prune did: the containers it removed, and those it left, each with why."""

    removed: tuple[str, ...]
    kept: Mapping[str, str]  # container id -> why it was left


def prune_gone(client: Any, selector: Mapping[str, str], here: RunIdentity) -> Pruned:
    """Remove the containers carrying the `selector` labels whose run is gone (`RunIdentity.why_kept`)."""
    removed: list[str] = []
    kept: dict[str, str] = {}
    chosen = [f"{name}={value}" for name, value in selector.items()]
    # Another run on the same engine may remove a container between the listing and its inspection: skip it.
    for container in client.containers.list(all=True, filters={"label": chosen}, ignore_removed=True):
        made_by = RunIdentity.from_labels(container.labels)
        why = "with no run labels (made by an older trajproxy)" if made_by is None else made_by.why_kept(here)
        if why is None:
            remove_containers(container)
            removed.append(container.id)
        else:
            kept[container.id] = why
    return Pruned(tuple(removed), kept)


def run_container(
    image: str, command: list[str], binds: Mapping[str, str], timeout_s: float, read_only: Mapping[str, str] = {}
) -> ExecResult:
    """Run a one-off container to its end (a bundle build): `binds` maps host folders to its paths, read-write,
    `read_only` host paths to its paths, read-only;
    it reaches the network the engine gives it (a package registry). It is removed, whatever happens; one whose
    caller died before removing it (killed while it ran, or between its end and its removal) carries that caller's
    identity, so the next build here, `trajproxy run` and `trajproxy sandbox prune` remove it."""
    here = RunIdentity.current()
    try:
        client = docker.from_env()
        prune_gone(client, BUNDLE_BUILD, here)
        ensure_image(client, image)
        container = client.containers.run(
            image,
            command,
            detach=True,
            volumes={
                **{host: {"bind": path, "mode": "rw"} for host, path in binds.items()},
                **{host: {"bind": path, "mode": "ro"} for host, path in read_only.items()},
            },
            labels={**BUNDLE_BUILD, **here.labels()},
        )
    except docker.errors.DockerException as e:
        raise SandboxError(f"could not start a build container from {image!r}: {e}") from e
    try:
        exit_code = int(container.wait(timeout=timeout_s)["StatusCode"])
        output = container.logs(stdout=True, stderr=True).decode("utf-8", "replace")
    except Exception as e:  # the wait timing out surfaces as a requests error
        raise SandboxError(f"the build container did not finish within {timeout_s:g} s: {e}") from e
    finally:
        remove_containers(container)
    return ExecResult(exit_code, output)
