"""``python -m stageb_pool``: the ``stageb-pool`` command."""

import sys

from .app.cli import main

sys.exit(main())
