"""The generation engines that live in the workers: the only code that imports torch and
transformers. ``contract`` (what an engine does), ``registry`` (the list of engines),
``records`` (the wire schema of the engine's requests and results) and ``models``' check of
``model.path`` are importable without torch, for the parent.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is ever imported: never touch a hub
