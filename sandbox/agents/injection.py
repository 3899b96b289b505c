"""An agent injected into a task's own container: its bundle mounted read-only, its files written, its command run.

The lifecycle is the same for every agent (mount, configure, run); what differs is its manifest. Nothing here
names an agent.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sandbox.agents.bundles import Bundle, Bundles
from sandbox.agents.manifests import BUNDLE_MOUNT, HOME, TASK_FILE, Manifest, Rendered, load


@dataclass(frozen=True, slots=True)
class InjectedAgent:
    """A manifest and the bundle built from it: what a run needs to start the agent in any task's image."""

    manifest: Manifest
    bundle: Bundle
    model: str | None = None  # the model name the agent asks for; None: the manifest's

    @property
    def mounts(self) -> dict[str, str]:
        return {str(self.bundle.path): BUNDLE_MOUNT}

    @property
    def record(self) -> dict[str, str]:
        """What an episode's metadata says about its agent."""
        return {"name": self.manifest.name, "version": self.manifest.version, "bundle": self.bundle.digest}

    @property
    def routes(self) -> list[dict[str, Any]]:
        return [dict(rule) for rule in self.manifest.routes]

    def render(self, *, base_url: str, key: str, task: str, workdir: str) -> Rendered:
        """The episode's command, env and files; `base_url` is trajproxy as the agent sees it (no /v1)."""
        return self.manifest.render(
            {
                "openai_base_url": f"{base_url}/v1",
                "anthropic_base_url": base_url,
                "gemini_base_url": base_url,
                "api_key": key,
                "model": self.model or self.manifest.model,
                "workdir": workdir,
                "task": task,
                "task_file": TASK_FILE,
                "home": HOME,
                "bundle": BUNDLE_MOUNT,
            }
        )


def inject(
    agent: str,
    model: str | None = None,
    bundles: Bundles | None = None,
    on_step: Callable[[str], None] = lambda _: None,
) -> InjectedAgent:
    """An agent ready to run in any task's image: a preset's name or a manifest's path, and its bundle, built now
    (once per machine; `on_step` is told each step) where it is not built yet. ValueError (ManifestError,
    BundleError) says in one line why it cannot be had."""
    manifest = load(agent)
    bundles = bundles or Bundles()
    return InjectedAgent(manifest, bundles.find(manifest) or bundles.build(manifest, on_step), model)


def launch_script(rendered: Rendered) -> str:
    """The agent's command, after a subshell that makes its HOME and writes its config files (owned by the agent's
    user, private to it): one exec, not two, as every round trip to the engine delays the agent's first call."""
    lines = ["set -e", "umask 077", f"mkdir -p {shlex.quote(HOME)}"]
    for file in rendered.files:
        folder = file.path.rsplit("/", 1)[0] or "/"
        lines.append(f"mkdir -p {shlex.quote(folder)}")
        lines.append(f"printf '%s' {shlex.quote(file.content)} > {shlex.quote(file.path)}")
    return "(\n" + "\n".join(lines) + "\n) || exit 1\n" + rendered.command
