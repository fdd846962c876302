"""Test doubles: stand-ins for the model engine, and the inputs of a run.

- ``fake_engine``: ``FakeEngine``, verdicts from fixed words in the ticket text, with knobs
  for dropped, unparseable and failing chunks; the audit, run-directory, headroom and
  rollout tests.
- ``scripted_engine``: ``ScriptedEngine``, verdicts from the guidance's "If any photo shows
  X, the verdict is fail." rules and proposer answers from a script; the rule search end to
  end and the tests that need one (resume, interrupts, signals, report).
- ``pool_engines``: plain methods for ``Pool.map`` (square, block, die once, ...); the pool's
  own tests and the driver scripts in tests/pool_scripts/.
- ``run_inputs``: tickets, seed guidance, proposer prompt and config of a run, for every
  test that runs one (``search_inputs`` for the scripted engine, ``audit_inputs`` for the
  fake engine and the tiny model).

Imported as ``doubles.<module>`` with tests/ on ``sys.path``: pytest puts it there (the
folder of tests/conftest.py); scripts and ``python -c`` children put it there themselves,
and the Ray tests give their clusters a PYTHONPATH with it, so that actors can unpickle the
pool engines. This file imports nothing, so a worker importing a pool engine pays for
nothing else.
"""
