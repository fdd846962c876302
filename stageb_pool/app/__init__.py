"""The application: the ``stageb-pool`` command, the config schema, one run (``job``), ``diff`` and progress."""
