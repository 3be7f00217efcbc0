"""The ``tierstore`` command: train, plan, profile, bench. The only package that prints (results for a person).

Owns: argument parsing and the commands (``main``) and ``tierstore train`` of the bundled model (``train``).
Leaves out: every decision the commands report; they call the session, the planner, the profiler and the
benchmarks.
"""
