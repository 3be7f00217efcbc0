"""The residency machine: exactly the listed transitions are legal; everything else raises."""

from __future__ import annotations

import itertools

import pytest

from tierstore.residency import LEGAL_TRANSITIONS, CopyState, IllegalTransitionError, check_transition

S = CopyState
EXPECTED_LEGAL = {
    (S.ABSENT, S.LOADING),
    (S.STALE, S.LOADING),
    (S.LOADING, S.CLEAN),
    (S.LOADING, S.DIRTY),
    (S.LOADING, S.ABSENT),
    (S.LOADING, S.STALE),
    (S.CLEAN, S.DIRTY),
    (S.CLEAN, S.STALE),
    (S.DIRTY, S.STALE),
    (S.DIRTY, S.CLEAN),
    (S.CLEAN, S.ABSENT),
    (S.STALE, S.ABSENT),
    (S.DIRTY, S.ABSENT),
}


def test_legal_set_is_the_documented_one() -> None:
    assert set(LEGAL_TRANSITIONS) == EXPECTED_LEGAL


@pytest.mark.parametrize("old,new", list(itertools.product(CopyState, CopyState)), ids=lambda s: s.value)
def test_every_pair(old: CopyState, new: CopyState) -> None:
    if old == new or (old, new) in EXPECTED_LEGAL:
        check_transition("k", "host", old, new)
    else:
        with pytest.raises(IllegalTransitionError) as info:
            check_transition("block.3/master", "nvme", old, new)
        message = str(info.value)
        assert "block.3/master" in message and "nvme" in message and f"{old.value} -> {new.value}" in message


def test_illegal_transition_is_a_runtime_error() -> None:
    """A broken invariant, not user error (design rule)."""
    assert issubclass(IllegalTransitionError, RuntimeError)


@pytest.mark.parametrize(
    "jump", [(S.ABSENT, S.CLEAN), (S.ABSENT, S.DIRTY), (S.STALE, S.CLEAN), (S.CLEAN, S.LOADING), (S.DIRTY, S.LOADING)]
)
def test_no_copy_becomes_current_without_a_transfer(jump: tuple[CopyState, CopyState]) -> None:
    with pytest.raises(IllegalTransitionError):
        check_transition("k", "gpu", *jump)


def test_is_current() -> None:
    assert {s for s in CopyState if s.is_current} == {S.CLEAN, S.DIRTY}
