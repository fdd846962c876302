"""The generation engines that live in the workers: the only code that imports torch and
transformers (``contract``, ``registry``, ``records`` and ``models`` import neither).
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is ever imported: never touch a hub
