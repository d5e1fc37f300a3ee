"""A corpus of real JAX-ecosystem programs run through polymask (issue #27).

Each module of this package copies the few functions one program needs from a
public library or example (source and license at its top) and registers the
programs in ``PROGRAMS`` (see ``corpus.py``). ``harness.py`` runs them through
``polymask.testing.check_oracle`` and ``polymask.jit``; ``tests/test_real_programs.py``
asserts the current results and ``tools/real_report.py`` prints the table.
"""
