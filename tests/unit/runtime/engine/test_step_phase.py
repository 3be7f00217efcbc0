"""The step phase machine: every pair of phases, legal or not (runtime/engine/step_phase.py)."""

from __future__ import annotations

import itertools

import pytest

from runtime.engine.step_phase import LEGAL_PHASE_TRANSITIONS, StepPhase, check_phase_transition

P = StepPhase
# The moves a step makes, written out independently of the table: run, commit, drop, recover.
EXPECTED = {
    (P.IDLE, P.BACKWARD), (P.BACKWARD, P.ACCUMULATING), (P.BACKWARD, P.READY), (P.ACCUMULATING, P.BACKWARD),
    (P.READY, P.IDLE), (P.BACKWARD, P.IDLE), (P.ACCUMULATING, P.IDLE), (P.BACKWARD, P.INTERRUPTED),
    (P.READY, P.INTERRUPTED), (P.ACCUMULATING, P.INTERRUPTED), (P.INTERRUPTED, P.IDLE), (P.IDLE, P.INTERRUPTED),
}


@pytest.mark.parametrize("old,new", list(itertools.product(StepPhase, StepPhase)))
def test_every_pair(old, new):
    if old == new or (old, new) in EXPECTED:
        check_phase_transition(old, new)
    else:
        with pytest.raises(RuntimeError, match=f"{old.value} -> {new.value}"):
            check_phase_transition(old, new)


def test_the_table_is_the_expected_moves():
    assert LEGAL_PHASE_TRANSITIONS == EXPECTED


def test_pending_phases():
    assert {p for p in StepPhase if p.pending} == {P.BACKWARD, P.ACCUMULATING, P.READY}
