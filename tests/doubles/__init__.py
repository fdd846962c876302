"""Test doubles: stand-ins for the model engine.

- ``pool_engines``: plain methods for ``Pool.map`` (square, block, die once, ...); the pool's
  own tests and the driver scripts in tests/pool_scripts/.

Imported as ``doubles.<module>`` with tests/ on ``sys.path``: pytest puts it there (the
folder of tests/conftest.py); scripts and ``python -c`` children put it there themselves,
and the Ray tests give their clusters a PYTHONPATH with it, so that actors can unpickle the
pool engines. This file imports nothing, so a worker importing a pool engine pays for
nothing else.
"""
