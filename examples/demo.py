"""The compose demo: build the example images, run the example task with scripted replies, print the reward.

Runs in the trajproxy image with the host's Docker socket mounted (see docker-compose.yml).
"""

import os
import subprocess
import sys

import docker

client = docker.from_env()
for path, tag in [("agents/minimal", "trajproxy/agent-minimal"), ("examples/tasks/calc", "trajproxy/example-calc")]:
    print(f"building {tag} from {path}", flush=True)
    client.images.build(path=path, tag=tag, rm=True)

sys.exit(
    subprocess.call(
        [
            "trajproxy", "run", "examples/tasks/calc/tasks.jsonl",
            # Baked into the example image: a bundle built here, inside a container, would sit where the host's
            # engine cannot mount it from.
            "--agent-cmd", "minimal-agent @{task_file} --workdir {workdir}",
            "--policy", "scripted:examples/tasks/calc/solve.script.jsonl",
            "--proxy-url", os.environ.get("TRAJPROXY_URL", "http://trajproxy:8000"),  # the scale profile's balancer too
            "--trainer-token", os.environ["TRAJPROXY_TRAINER_TOKEN"],
            "--socket-source", os.environ.get("TRAJPROXY_SOCKETS_VOLUME", "trajproxy-sockets"),
        ]
    )
)  # fmt: skip
