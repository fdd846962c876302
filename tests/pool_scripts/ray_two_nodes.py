"""A two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head and one more
node, each with 1 CPU and 2 declared GPUs), a Ray pool of 4 GPU workers on it, and a JSON
report on the last line of stdout: the results, each worker's node, and the actor processes
still alive after ``close()``.

usage: ray_two_nodes.py   (run by tests/test_ray.py in a child process of its own)
"""

import json
import os
import secrets
import sys
import time

# Token auth from the environment for every node and this driver (no ~/.ray/auth_token).
os.environ.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]  # tests/, the checkout

from doubles.pool_engines import Uniform  # noqa: E402
from processes import gone  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from stageb_pool import Pool  # noqa: E402
from stageb_pool.pool import Ray  # noqa: E402


def main() -> None:
    node = dict(num_cpus=1, num_gpus=2, object_store_memory=80 * 2**20)
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        with Pool(Uniform, "4", backend=Ray(cluster.address), task_timeout=60) as pool:
            results = pool.map("square", list(range(12)))
            nodes = [where["node_id"] for where in pool.placement]
            actors = [where["pid"] for where in pool.placement]
        deadline = time.monotonic() + 10
        while not all(gone(pid) for pid in actors) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        cluster.shutdown()
    print(json.dumps({"results": results, "nodes": nodes, "left": [p for p in actors if not gone(p)]}))


if __name__ == "__main__":
    main()
