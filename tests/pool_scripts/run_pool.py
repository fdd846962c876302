"""A parent process that runs a pool and blocks in gather; the tests signal or kill it.

usage: run_pool.py STATE_DIR [slow-start]
Writes STATE_DIR/pids.json (worker and zygote pids) once the pool is up, then maps a
blocking task over the workers. With ``slow-start`` the workers' engines start only when
the parent has left them (each touches STATE_DIR/starting.<pid> first), so the pool is
interrupted while it starts. Exits 130 on Ctrl-C, like the CLI.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]  # tests/, the checkout

from doubles.pool_engines import Engine, StartsWhenTheParentLeaves, touch  # noqa: E402
from processes import parent_pid  # noqa: E402

from stageb_pool import Pool  # noqa: E402


def main(state_dir: str, mode: str = "") -> int:
    engine = Engine
    if mode == "slow-start":
        marker = os.path.join(state_dir, "starting")
        engine = lambda device: StartsWhenTheParentLeaves(device, marker)  # noqa: E731
    try:
        with Pool(engine, "cpu:2") as pool:
            pids = {"workers": pool.pids, "zygote": parent_pid(pool.pids[0])}
            touch(os.path.join(state_dir, "pids.json"), json.dumps(pids))
            pool.map("block", [os.path.join(state_dir, "started")] * 2)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
