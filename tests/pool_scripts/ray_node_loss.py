"""A Ray pool of one CPU worker (``max_restarts=2``) on an existing multi-node cluster whose
nodes the test takes away: the JSON report on stdout (its only line) says what the pool did.

usage: ray_node_loss.py ADDRESS STATE_DIR   (env: RAY_AUTH_TOKEN, the cluster's token)
Round 1: ``hold_once`` over 6 items blocks on item 3 (STATE_DIR/held.1 appears, with the
worker's node in STATE_DIR/node.1); the test kills that node; the pool must replace the
worker on the other node and finish. Round 2: the same, with no node left to take the
replacement; the pool must fail saying so. Times are wall-clock (time.time), for the test
to compare with when it killed the node.
"""

import json
import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]  # tests/, the checkout

from doubles.pool_engines import Uniform, touch  # noqa: E402

from stageb_pool import Pool, PoolError  # noqa: E402
from stageb_pool.pool import Ray  # noqa: E402


class Remember(logging.Handler):
    """The pool's log records, with their times."""

    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append({"t": record.created, "msg": record.getMessage()})


def main(address: str, state: str) -> None:
    remember = Remember()
    logging.getLogger("stageb_pool").addHandler(remember)
    report = {}
    with Pool(Uniform, "cpu:1", backend=Ray(address, connect_timeout=30), max_restarts=2, task_timeout=120,
              start_timeout=120) as pool:
        for round_ in (1, 2):
            touch(os.path.join(state, f"node.{round_}"), pool.placement[0]["node_id"])
            try:
                report[f"results.{round_}"] = pool.map("hold_once", list(range(6)),
                                                       marker=os.path.join(state, f"held.{round_}"))
            except PoolError as exc:
                report[f"error.{round_}"] = {"t": time.time(), "type": type(exc).__name__, "msg": str(exc)}
                break
            report[f"restarts.{round_}"] = pool.stats.restarts
            report[f"done.{round_}"] = time.time()
    report["log"] = remember.records
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
