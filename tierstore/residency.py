"""The state of one copy of a tensor on one tier, and the legal transitions between states.

Every stored tensor has a home tier (its lowest, permanent copy) and may have cached copies on faster
tiers. A copy is ABSENT (no bytes reserved), LOADING (bytes reserved, a transfer into it in flight),
CLEAN (holds the newest value, and so does home), DIRTY (holds the newest value, home does not) or STALE
(bytes reserved, value out of date). "Current" means CLEAN or DIRTY. The rule that keeps data safe, checked
by the store: the last current copy is never dropped -- a DIRTY copy must be evicted (written back) first.
"""

from __future__ import annotations

import enum


class CopyState(enum.Enum):
    """State of one tier's copy of a tensor."""

    ABSENT = "absent"
    LOADING = "loading"
    CLEAN = "clean"
    DIRTY = "dirty"
    STALE = "stale"

    @property
    def is_current(self) -> bool:
        """True when the copy holds the newest value."""
        return self in (CopyState.CLEAN, CopyState.DIRTY)


class IllegalTransitionError(RuntimeError):
    """A state change that the residency machine forbids: a bug in the caller, never user error."""


LEGAL_TRANSITIONS: frozenset[tuple[CopyState, CopyState]] = frozenset(
    {
        (CopyState.ABSENT, CopyState.LOADING),  # fetch / stage / evict begins filling this tier
        (CopyState.STALE, CopyState.LOADING),  # an out-of-date copy is refreshed
        (CopyState.LOADING, CopyState.CLEAN),  # the transfer in completed; home has the same value
        (CopyState.LOADING, CopyState.DIRTY),  # the transfer in completed; home is older
        (CopyState.LOADING, CopyState.ABSENT),  # the transfer in failed; reservation returned
        (CopyState.LOADING, CopyState.STALE),  # a write back home failed; home keeps its file, not the value
        (CopyState.CLEAN, CopyState.DIRTY),  # the holder modified the copy (e.g. an optimizer step)
        (CopyState.CLEAN, CopyState.STALE),  # another copy was modified
        (CopyState.DIRTY, CopyState.STALE),  # another copy was modified after this one
        (CopyState.DIRTY, CopyState.CLEAN),  # the value was written back home
        (CopyState.CLEAN, CopyState.ABSENT),  # release
        (CopyState.STALE, CopyState.ABSENT),  # release of an out-of-date copy
        (CopyState.DIRTY, CopyState.ABSENT),  # release of a dirty copy: legal only while a twin is current
    }
)


def check_transition(key: str, tier: str, old: CopyState, new: CopyState) -> None:
    """Raise IllegalTransitionError unless old -> new is legal."""
    if old == new:
        return
    if (old, new) not in LEGAL_TRANSITIONS:
        raise IllegalTransitionError(f"{key} on {tier}: illegal transition {old.value} -> {new.value}")
