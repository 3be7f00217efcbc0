"""The step's counters and its observers: what the engine's parts count and tell the profiler.

Each part adds to one ``StepStats`` and calls the listener lists it was handed (the profiler appends to the same
lists, through the controller). What it leaves out: the events' types (``runtime.core.events``) and what is done
with them (``runtime.profiler``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.core.events import StallEvent

log = logging.getLogger(__name__)

STATS_HISTORY = 1024  # entries kept of per-step statistics


@dataclass
class StepStats:
    """Counters of the step in progress / the last step, for logs and the profiler."""

    wait_update_s: float = 0.0  # host time blocked on the worker (an update not yet done)
    wait_fetch_s: float = 0.0  # host time blocked on weight fetches issued on demand
    # perf_counter at the end of each recent backward, and recent clipping norms: bounded, a run may be long.
    backward_end_s: deque[float] = field(default_factory=lambda: deque(maxlen=STATS_HISTORY))
    skipped_steps: int = 0
    grad_norms: deque[float] = field(default_factory=lambda: deque(maxlen=STATS_HISTORY))
    # Steps whose updates waited for the commit without running early: the step before them would have
    # redone its early updates (it clipped or overflowed), so this one was not expected to keep them.
    speculation_paused: int = 0
    early_updates: int = 0  # host updates queued to run before their commit (each is published or redone)
    early_reads: int = 0  # spilled blocks whose moments were read from NVMe during the micro-batches, before the commit
    held_grads: int = 0  # host-updated blocks whose gradient waited on the device and was scaled there ([Note: held gradients])


def emit(listeners: list[Callable[[Any], None]], event: object) -> None:
    """Call every listener with the event; an observer's bug is logged, never raised into training."""
    for listener in list(listeners):
        try:
            listener(event)
        except Exception:  # an observer's bug must never break training
            log.exception("controller listener %r failed", listener)


def emit_stall(listeners: list[Callable[[StallEvent], None]], index: int, cause: str, seconds: float, step: int,
               start_s: float) -> None:
    """Tell the listeners that block index stalled the training thread for ``seconds`` (``cause``: ``STALL_*``)."""
    emit(listeners, StallEvent(index, cause, seconds, step, start_s))
