"""The ``tierstore`` command: train, plan, profile, bench. The only package that prints (results for a person).

Owns: argument parsing and the commands (``main``); ``tierstore train``'s loop (``train``, over a ``job.TrainJob``: the
bundled model, or a local HF model with ``--model DIR --data FILE`` from ``train_hf`` and ``text_data``); ``tierstore
plan`` (``plan``).
Leaves out: every decision the commands report; they call the session, the planner, the profiler and the
benchmarks.
"""
