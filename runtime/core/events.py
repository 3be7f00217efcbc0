"""What the engine tells its listeners: a stall (the GPU waited, and why) and a committed step.

The profiler and the measured placement read these; the engine publishes them. Plain data, so that every layer
may import them.
"""

from __future__ import annotations

from dataclasses import dataclass

# Why the training thread waited (StallEvent.cause).
STALL_FETCH_HOST = "fetch_host"  # an on-demand weight fetch from pinned host memory (a prefetch miss)
STALL_FETCH_NVME = "fetch_nvme"  # an on-demand weight fetch whose bytes had to be staged from NVMe first
STALL_UPDATE = "update"  # the block's CPU Adam update had not landed yet
STALL_CAPACITY = "capacity"  # an on-demand fetch of a block whose prefetch the full GPU budget refused
STALL_GRAD_SUM = "grad_sum"  # a micro-batch's gradient waited for a host-sum buffer (the CPU sums fell behind)


@dataclass(frozen=True)
class StallEvent:
    """Host time the training thread spent blocked on one block, and why (for listeners such as the profiler)."""

    block: int
    cause: str  # one of the STALL_* names
    seconds: float
    step: int  # committed optimizer steps when the wait happened (the step in progress is step + 1)
    start_s: float = 0.0  # time.perf_counter() when the wait began


@dataclass(frozen=True)
class StepEvent:
    """A step boundary: "begin" when a forward starts (on_step_begin), "commit" in step(), "drop" when the step in
    progress was dropped (discard_pending: zero_grad() before step(), a caught exception in a backward) or its
    first forward raised (seen when the next forward begins, before its "begin")."""

    kind: str
    step: int  # committed optimizer steps after the event
    time_s: float  # time.perf_counter()
    signature: str = ""  # begin: "train", "eval" or "grad-eval"
