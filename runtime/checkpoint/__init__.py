"""Crash-safe checkpoints of tiered training state, and exact resume.

Owns: saving and loading a session's whole state (``state``), the flat files with their manifest and atomic
publication (``files``), reading ``meta.json`` without trusting it (``meta``) and the locked root a run writes
into (``root``). Leaves out: how the state is used in a step; it reads and writes through the session.
"""

from runtime.checkpoint.state import CheckpointError, CheckpointRoot, bench_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "CheckpointRoot", "bench_checkpoint", "load_checkpoint", "save_checkpoint"]
