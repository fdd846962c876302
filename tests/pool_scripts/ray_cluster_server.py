"""A multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``) that tests drive
over stdin/stdout, one JSON object per line, so that one cluster serves a whole test module.

usage: ray_cluster_server.py   (env: RAY_AUTH_TOKEN, the cluster's token)
Starts a head with no CPU (so no worker lands on it and it can never be the node a test
kills) and two nodes of 1 CPU, then answers:
  {"address": ..., "nodes": [...]}                      once the cluster is up
  "nodes"            -> {"nodes": [{"node_id", "cpus"}, ...]}   the live worker nodes
  "kill NODE_ID"     -> {"killed": NODE_ID}   its raylet and workers SIGKILLed (a lost node)
  "add"              -> {"nodes": [...]}      one more node of 1 CPU, once it is registered
EOF on stdin shuts the cluster down.
"""

import json
import os
import sys

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["RAY_AUTH_MODE"] = "token"

from ray.cluster_utils import Cluster  # noqa: E402

NODE = dict(num_cpus=1, object_store_memory=80 * 2**20)


def say(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args=dict(NODE, num_cpus=0, include_dashboard=False))
    nodes = {}
    try:
        for _ in range(2):
            node = cluster.add_node(**NODE)
            nodes[node.node_id] = node
        cluster.wait_for_nodes()
        listing = lambda: [{"node_id": n, "cpus": 1} for n in nodes]  # noqa: E731
        say({"address": cluster.address, "nodes": listing()})
        for line in sys.stdin:
            command, _, arg = line.strip().partition(" ")
            if command == "nodes":
                say({"nodes": listing()})
            elif command == "kill":
                cluster.remove_node(nodes.pop(arg), allow_graceful=False)
                say({"killed": arg})
            elif command == "add":
                node = cluster.add_node(**NODE)
                nodes[node.node_id] = node
                cluster.wait_for_nodes()
                say({"nodes": listing()})
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
