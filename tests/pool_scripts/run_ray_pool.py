"""A parent that runs a Ray pool on a local cluster the pool starts itself (address "local"),
then blocks in ``map``; the test interrupts it.

usage: run_ray_pool.py STATE_DIR
Writes STATE_DIR/pids.json (the actors' pids) once the pool is up; each actor touches
STATE_DIR/started.<pid> inside its task. Exits 130 on Ctrl-C, like the CLI.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]  # tests/, the checkout

from doubles.pool_engines import Uniform, touch  # noqa: E402

from stageb_pool import Pool  # noqa: E402
from stageb_pool.pool import Ray  # noqa: E402


def main(state_dir: str) -> int:
    try:
        with Pool(Uniform, "cpu:2", backend=Ray("local"), task_timeout=300) as pool:
            touch(os.path.join(state_dir, "pids.json"), json.dumps({"actors": [p["pid"] for p in pool.placement]}))
            pool.map("block", [os.path.join(state_dir, "started")] * 2)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
