"""The prefetch schedule: learns the order in which blocks are needed and says what to fetch next.

Pure logic, no torch. A step is a sequence of *uses* ``(block, phase)`` with phase "fwd", "bwd" or
"recompute". The first step of each signature (train / eval / any other path) records the sequence; later
steps follow it with a cursor and, at each use, return the next blocks within a depth and byte budget.
When execution diverges (a data-dependent branch, a different path) the cursor re-synchronises on the
next matching use, and the step's observed sequence replaces the trace at its end: the schedule repairs
itself instead of switching prefetch off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Use = tuple[int, str]


def joins_window(count: int, total_nbytes: int, nbytes: int, limit: int, budget_nbytes: int) -> bool:
    """Whether a block of ``nbytes`` joins a prefetch window that holds ``count`` blocks of ``total_nbytes``: the
    window takes at most ``limit`` blocks within the byte budget, the first block whatever its size."""
    return count < limit and (count == 0 or total_nbytes + nbytes <= budget_nbytes)


@dataclass
class ScheduleStats:
    """Counters of how well the schedule predicted the uses."""

    hits: int = 0  # the block was already fetched (or in flight) when it was needed
    misses: int = 0  # the block had to be fetched on demand
    divergences: int = 0  # uses that did not match the trace at the cursor
    repairs: int = 0  # traces replaced after a divergent step

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 1.0 before any use."""
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


@dataclass
class _Trace:
    uses: list[Use] = field(default_factory=list)


class PrefetchSchedule:
    """Keeps one trace per signature and predicts upcoming block uses."""

    def __init__(self, depth: int, budget_nbytes: int, block_nbytes: Callable[[int], int],
                 fetched: Callable[[int], bool] = lambda block: True):
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self.depth = depth
        self.budget_nbytes = budget_nbytes
        self._block_nbytes = block_nbytes
        # Whether a block's weights are fetched at all: one that stays on the device (updated there) takes no
        # place in the window, so it is passed over rather than spending the depth.
        self._fetched = fetched
        self._traces: dict[str, _Trace] = {}
        self._signature: str | None = None
        self._observed: list[Use] = []
        self._cursor = 0  # index in the trace of the next expected use
        self._diverged = False
        self.stats = ScheduleStats()

    @property
    def signature(self) -> str | None:
        """The signature of the step in progress, if any."""
        return self._signature

    def traces(self) -> dict[str, list[Use]]:
        """A copy of every recorded trace."""
        return {sig: list(t.uses) for sig, t in self._traces.items()}

    def begin(self, signature: str) -> None:
        """Start a step of the given signature (ending any step in progress)."""
        if self._signature is not None:
            self.end()
        self._signature = signature
        self._observed = []
        self._cursor = 0
        self._diverged = False

    def observe(self, block: int, phase: str) -> None:
        """Record that block is needed now in phase, and move the cursor past it in the trace."""
        if self._signature is None:
            self.begin("other")
        use = (block, phase)
        self._observed.append(use)
        trace = self._traces.get(self._signature)  # type: ignore[arg-type]
        if trace is None:
            return
        if self._cursor < len(trace.uses) and trace.uses[self._cursor] == use:
            self._cursor += 1
            return
        self._diverged = True
        self.stats.divergences += 1
        # Re-synchronise on the next occurrence of this use ahead of the cursor, else stay put.
        for i in range(self._cursor, len(trace.uses)):
            if trace.uses[i] == use:
                self._cursor = i + 1
                return

    def upcoming(self, limit: int | None = None, *, wrap_limit: int = 0) -> list[int]:
        """Distinct fetched blocks expected next, in order, within depth (``limit``) and the byte budget. With
        ``wrap_limit``, when the step's trace ends within the depth and the budget, the next step of the same
        signature's first blocks follow, up to ``wrap_limit`` blocks in all: the backward of a micro-batch that another follows fetches the
        next forward's first blocks while the copy engine would idle, and keeps its own last ones, which that
        forward needs first."""
        trace = self._traces.get(self._signature) if self._signature else None
        if trace is None:
            return []
        limit = self.depth if limit is None else limit
        picked, total, ran_out = self._pick(trace.uses[self._cursor :], limit, [], 0)
        if wrap_limit and ran_out:  # this pass ends within the depth and the byte budget
            picked, _, _ = self._pick(trace.uses, max(limit, wrap_limit), picked, total)
        return picked

    def _pick(self, uses: list[Use], limit: int, picked: list[int], total: int) -> tuple[list[int], int, bool]:
        """``picked`` extended by the distinct fetched blocks of ``uses`` until ``limit`` blocks or the byte budget
        (``joins_window``), with the bytes picked in all, and whether ``uses`` ran out first."""
        for block, _phase in uses:
            if block in picked or not self._fetched(block):
                continue
            nbytes = self._block_nbytes(block)
            if not joins_window(len(picked), total, nbytes, limit, self.budget_nbytes):
                return picked, total, False
            picked.append(block)
            total += nbytes
        return picked, total, len(picked) < limit

    def next_use(self) -> int | None:
        """The block the trace expects next, whatever its placement (None: no trace, or its end). Depends only on the
        uses observed, so ranks that run the same model path agree on it ([Note: collectives in program order])."""
        trace = self._traces.get(self._signature) if self._signature else None
        if trace is None or self._cursor >= len(trace.uses):
            return None
        return trace.uses[self._cursor][0]

    def needed_within(self, block: int, num_uses: int) -> bool:
        """True when block is expected again within the next num_uses uses (so releasing it would waste a fetch)."""
        trace = self._traces.get(self._signature) if self._signature else None
        if trace is None:
            return False
        return any(b == block for b, _ in trace.uses[self._cursor : self._cursor + num_uses])

    def record_fetch(self, hit: bool) -> None:
        """Count a use as a prefetch hit or an on-demand miss."""
        if hit:
            self.stats.hits += 1
        else:
            self.stats.misses += 1

    def end(self) -> None:
        """Close the step: record its uses as the trace of its signature if new or divergent."""
        if self._signature is None:
            return
        trace = self._traces.get(self._signature)
        if trace is None:
            self._traces[self._signature] = _Trace(list(self._observed))
        elif self._diverged or len(self._observed) != len(trace.uses):
            trace.uses = list(self._observed)
            self.stats.repairs += 1
        self._signature = None
        self._observed = []
        self._cursor = 0
