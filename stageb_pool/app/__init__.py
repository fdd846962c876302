"""The application: the ``stageb-pool`` command, the config schema, one run from start to
finish (``job``), run comparison (``diff``) and progress reporting.
"""
