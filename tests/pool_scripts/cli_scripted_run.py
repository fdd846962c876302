"""``stageb-pool`` (the real CLI, in a process of its own) with the scripted engine in place
of the model, for tests that signal the main process or the zygote.

usage: cli_scripted_run.py MARKER CLI-ARGS...
Every worker's proposer call of iteration 2 touches MARKER and then blocks, so the test
knows the run is inside a rollout with its pool up.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]  # tests/, the checkout

from doubles import scripted_engine as se  # noqa: E402

from stageb_pool.app import cli, job  # noqa: E402

if __name__ == "__main__":
    marker = sys.argv[1]
    job.engine_factory_for = lambda *args, **kwargs: se.scripted_factory(hang_at=2, marker=marker)
    sys.exit(cli.main(sys.argv[2:]))
