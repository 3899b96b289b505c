"""A local Ray cluster of two nodes on this machine, each declaring sandbox slots (tests/test_ray.py,
benchmarks/ray_run.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

SLOTS = 2  # per node
_SMALL = 80 * 1024**2  # each raylet's object store: the least Ray takes


@contextlib.contextmanager
def two_nodes(slots: int = SLOTS) -> Iterator[Any]:
    """A local Ray cluster: a head with no slots (the driver's) and two nodes with `slots` sandbox slots each;
    Ray's dashboard off, its object stores the least it takes, its health checks quick."""
    system = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
    head = {"num_cpus": 0, "include_dashboard": False, "object_store_memory": _SMALL, "_system_config": system}
    import ray.cluster_utils  # lazy: Ray takes seconds to import, and it is an extra (trajproxy[ray]; dev has it)

    made: Any = ray.cluster_utils.Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(2):
            made.add_node(num_cpus=1, resources={"trajproxy_sandboxes": slots}, object_store_memory=_SMALL)
        yield made
    finally:
        made.shutdown()
