"""What the profiler records, as plain data: cumulative counters, a mark per committed step, and the snapshot
``analysis`` and ``outputs`` work on. No behaviour beyond copying; the listening side is ``collect``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.core.events import StallEvent
from tierstore import TransferEvent


@dataclass
class Counters:
    """Cumulative bytes, transfer count and summed duration per transfer kind."""

    nbytes: dict[str, int] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        """Count one transfer."""
        self.nbytes[kind] = self.nbytes.get(kind, 0) + nbytes
        self.count[kind] = self.count.get(kind, 0) + 1
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def copy(self) -> Counters:
        """An independent snapshot."""
        return Counters(dict(self.nbytes), dict(self.count), dict(self.seconds))


@dataclass(frozen=True)
class StepMark:
    """What the profiler knew when step ``step`` was committed (cumulative figures; see the module doc)."""

    step: int
    begin_s: float  # the first training forward of the step (or the previous commit when none was seen)
    backward_end_s: float  # the end of the step's last backward (the end of its GPU work window)
    commit_s: float
    num_transfers: int  # transfers recorded so far
    num_stalls: int  # stalls recorded so far
    counters: Counters
    hits: int
    misses: int
    wait_inputs_s: float  # the worker's cumulative wait for its inputs (gradient copies, NVMe reads)
    usage: dict[str, int]  # bytes in use per tier ("gpu", "host", "nvme")
    # Seconds measured placement spent after this commit (FirstStepPlacement.placing_s): it places the run there
    # (moving state, reading spilled moments back), which is neither this step's time nor the next one's.
    placing_s: float = 0.0


@dataclass
class RawProfile:
    """A snapshot of everything recorded; the input of ``analysis.summarize`` and of the trace writer."""

    t0_s: float  # time.perf_counter() at start: every time in the outputs is relative to it
    end_s: float
    transfers: list[TransferEvent]
    stalls: list[StallEvent]
    adam: list[tuple[int, int, float, float]]  # (block, step, start_s, end_s) of each update
    marks: list[StepMark]
    counters: Counters
    hits: int
    misses: int
    wait_inputs_s: float
    dropped_events: int
    meta: dict[str, Any]  # device, config, blocks, ceilings, memory: see Profiler._meta
    ceilings_gbps: dict[str, float]
    adam_split_s: dict[str, float] = field(default_factory=dict)  # collect.adam_split over the profile
