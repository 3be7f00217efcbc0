"""Where the optimizer step in progress is, and the legal moves between phases. Pure logic, no torch.

A step is a transaction (docs/design.md): its micro-batches' backwards run, then ``optimizer.step()`` commits it, or
``zero_grad()`` / a caught exception drops it. The controller (``runtime.engine.controller``) holds one ``StepPhase``
and changes it only through ``check_phase_transition``; everything outside reads ``Controller.step_pending``.

- IDLE: nothing since the last commit or drop.
- BACKWARD: a backward is running (any micro-batch; recomputed forwards of checkpointed blocks run inside it).
- ACCUMULATING: between micro-batches, the step's last backward still to come.
- READY: the last micro-batch's backward ended; ``optimizer.step()`` commits.
- INTERRUPTED: a dropped step whose updates had started as gradients landed left blocks at different steps, or a
  checkpoint load was cut short (``runtime.checkpoint.state``); only a complete checkpoint load (every block at one step
  again) leaves it. Also a placement change between steps that
  failed and could not be undone (``Controller.adopt_placement``): the next step refuses, saying why.

What it leaves out: what happens on each move (the controller's methods), the update jobs' own phases
(``runtime.update.worker.JobPhase``).
"""

from __future__ import annotations

import enum


class StepPhase(enum.Enum):
    """The phase of the optimizer step in progress (see the module docstring)."""

    IDLE = "idle"
    BACKWARD = "backward"
    ACCUMULATING = "accumulating"
    READY = "ready"
    INTERRUPTED = "interrupted"

    @property
    def pending(self) -> bool:
        """True from the first backward of a step until ``optimizer.step()`` commits it (or it is dropped)."""
        return self in (StepPhase.BACKWARD, StepPhase.ACCUMULATING, StepPhase.READY)


LEGAL_PHASE_TRANSITIONS: frozenset[tuple[StepPhase, StepPhase]] = frozenset(
    {
        (StepPhase.IDLE, StepPhase.BACKWARD),  # a step's first backward begins
        (StepPhase.BACKWARD, StepPhase.ACCUMULATING),  # a micro-batch before the last ended
        (StepPhase.BACKWARD, StepPhase.READY),  # the last micro-batch's backward ended
        (StepPhase.ACCUMULATING, StepPhase.BACKWARD),  # the next micro-batch's backward begins
        (StepPhase.READY, StepPhase.IDLE),  # optimizer.step() committed, or the step was dropped
        # Dropped (zero_grad() before step(), a caught exception, the next forward after a failed backward):
        (StepPhase.BACKWARD, StepPhase.IDLE),
        (StepPhase.ACCUMULATING, StepPhase.IDLE),
        # ... after updates had started as gradients landed (streaming): blocks are at different steps.
        (StepPhase.BACKWARD, StepPhase.INTERRUPTED),
        (StepPhase.READY, StepPhase.INTERRUPTED),
        (StepPhase.ACCUMULATING, StepPhase.INTERRUPTED),  # ... or dropping one failed part-way (discard_pending)
        (StepPhase.INTERRUPTED, StepPhase.IDLE),  # a checkpoint load put every block at one step
        (StepPhase.IDLE, StepPhase.INTERRUPTED),  # a placement change that could not be undone (adopt_placement)
    }
)


def check_phase_transition(old: StepPhase, new: StepPhase) -> None:
    """Raise RuntimeError unless ``old -> new`` is legal (a controller bug, never user error); staying is legal."""
    if old == new:
        return
    if (old, new) not in LEGAL_PHASE_TRANSITIONS:
        raise RuntimeError(f"illegal step phase transition {old.value} -> {new.value}")
