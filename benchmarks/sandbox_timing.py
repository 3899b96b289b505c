"""Timing a sandbox's start from the outside: a docker client whose container creates, starts, uploads and execs
are marked on a stopwatch, and DockerSandboxes built on it (`sandbox_start.py` splits each start into its steps)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from sandbox.backends.docker_sandboxes import DockerSandbox, DockerSandboxes
from sandbox.backends.interface import SandboxSpec

EPISODE_LABEL = "trajproxy.episode"
Marks = dict[str, dict[str, float]]


class Stopwatch:
    """The first time each named step of each episode was reached (unix seconds, the server's clock too)."""

    def __init__(self) -> None:
        self.marks: Marks = defaultdict(dict)

    def mark(self, episode: str | None, name: str) -> None:
        if episode is not None:
            self.marks[episode].setdefault(name, time.time())


class TimedContainer:
    """A docker container whose upload and first exec are marked."""

    def __init__(self, container: Any, episode: str | None, watch: Stopwatch) -> None:
        self._container, self._episode, self._watch = container, episode, watch

    def put_archive(self, *args: Any, **kwargs: Any) -> Any:
        done = self._container.put_archive(*args, **kwargs)
        self._watch.mark(self._episode, "uploaded")
        return done

    def exec_run(self, *args: Any, **kwargs: Any) -> Any:
        self._watch.mark(self._episode, "exec")
        return self._container.exec_run(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._container, name)


class TimedContainers:
    def __init__(self, containers: Any, watch: Stopwatch) -> None:
        self._containers, self._watch = containers, watch

    def create(self, image: str, command: list[str], **options: Any) -> Any:
        episode = options.get("labels", {}).get(EPISODE_LABEL)
        role = "gate" if command[:2] == ["python3", "-c"] else "agent"
        self._watch.mark(episode, f"{role} create")
        container = self._containers.create(image, command, **options)
        started, watch = container.start, self._watch

        def start(*args: Any, **kwargs: Any) -> Any:
            result = started(*args, **kwargs)
            watch.mark(episode, f"{role} started")
            return result

        container.start = start
        return container if role == "gate" else TimedContainer(container, episode, watch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._containers, name)


class TimedDocker:
    """A docker client whose container starts, uploads and execs are marked on a stopwatch."""

    def __init__(self, client: Any, watch: Stopwatch) -> None:
        self._client = client
        self.containers = TimedContainers(client.containers, watch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class TimedSandboxes(DockerSandboxes):
    """DockerSandboxes that marks when each episode's (first) sandbox was asked for."""

    def __init__(self, socket_source: str, watch: Stopwatch, client: Any, label: str, gate_pool: int) -> None:
        labels = {"trajproxy.bench": label}
        super().__init__(socket_source, labels=labels, client=TimedDocker(client, watch), gate_pool=gate_pool)
        self._watch = watch

    async def start(self, spec: SandboxSpec) -> DockerSandbox:
        if spec.proxy:
            self._watch.mark(spec.labels.get(EPISODE_LABEL), "start")
        return await super().start(spec)
