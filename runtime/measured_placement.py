"""Auto placement chosen from the first step's measured GPU peak, not from a guessed activation reserve.

``auto`` placement (``runtime.autoplace``) must leave room for activations it cannot see before a step runs.
A share of the free budget is wrong both ways: under DeepSpeed ZeRO-2's reservation (31 GiB on an H100) the
1.35B benchmark's first step reached 25.1 GiB beyond its plan (reserved bytes, weights resident; call Z3 in
docs/measurements-history.md) and three quarters of the free budget left its first forward out of memory, while the 8B scenario under a 24 GiB cap used half of what was reserved. So when
``optimizer.gpu_update_fraction`` and ``tiers.gpu.activation_reserve`` are both ``auto`` on a GPU, the session's
first step runs with every update on the CPU, and nothing streamed or kept for backward where those are ``auto``
(the plan's smallest GPU footprint, shown by ``tierstore plan``); at its commit the peak it reached is read, auto placement
is asked again with the reserve that peak supports (``runtime.peak_hint.supported_reserve``: the bytes beyond
the plan plus a margin), and the first blocks it chooses move their master and moments to the GPU
(``Controller.adopt_placement``). The log (and the session's plan notes) say what was measured and chosen.

The peak is the allocator's reserved bytes, not the allocated ones: a memory-fraction cap limits the former, and
the difference is the fragmentation the step itself caused. Under an 8 GiB cap (H100, 2026-11-27) a reserve
from the allocated peak left the second step 0.75 GiB short. With weights fetched from host the reserved peak
was 2-3 GiB above the allocated one on the benchmark model under ZeRO-2's memory (calls Z2, Z3), enough that auto
placement could not afford the hand-set row's keep_for_backward; the line also says what the allocator holds
at the commit for the compute stream and for side streams and how much of each is cached free (a cache of the
weight fetches' copy stream serves only that stream), to tell how much of such a difference is that cache (not
yet run on a GPU).

What it leaves out: sessions whose first-step plan spills moments to NVMe or sums micro-batch gradients in host
memory, and accumulated steps that may fetch a compute-dtype copy of the weights (chosen for the first step, the
copy would rule out streaming): they keep the placement chosen at offload, with the share-based reserve; giving memory back to the host (the pinned arena was sized for the first step's plan, where every
update runs on the CPU); and a later step that needs more memory than the first one (longer sequences: the
margin covers some, ``runtime.oom_hint`` names the setting when it does not). Steps before the first training
step (an evaluation) are not measured: the allocator's cache is emptied and the process's peak statistics are
reset when the first forward that records a graph begins (``torch.cuda.reset_peak_memory_stats``: a user's own
peak figures restart there too). The bytes moved to the GPU are not transfer events (the profiler's traffic
counts them not).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from runtime.autoplace import Placement
from runtime.controller import StepEvent
from runtime.peak_hint import StreamPools, supported_reserve
from runtime.units import approx_size
from tierstore import CapacityError

log = logging.getLogger(__name__)

FIRST_STEP_NOTE = ("auto placement: chosen from the first step's measured GPU peak (runtime.measured_placement): "
                   "the first step updates on the CPU, streaming and keeping nothing where those are auto; the "
                   "GPU's share follows")


class FirstStepPlacement:
    """A controller step listener: resets the peak statistics when the session's first training forward begins,
    and at that step's commit asks auto placement for the reserve its peak supports and adopts the answer.

    ``plan_gpu_nbytes`` / ``budget_nbytes``: the first step's plan on the GPU and the store's GPU budget; ``ask``:
    the placement at a reserve (None: the session is gone); ``adopt``: make it the session's (raises
    CapacityError or torch.OutOfMemoryError, changing nothing, when the GPU tier or the device has no room;
    should a moved key not go back, the controller is interrupted and the next step refuses); ``peak`` / ``reset_peak``: the process's
    peak reserved GPU bytes and its reset; ``report``: where the outcome's line goes besides the log (the
    session's plan notes, which benchmarks and profiles print); ``pools``: the bytes the allocator holds at the
    commit for the compute stream and for side streams, and how much of each is cached free
    (``runtime.peak_hint.cuda_reserved_by_stream``), said in the line: side streams hold the fetched weights and
    a cache only they can use, part of a peak beyond the plan that activations never took (None: not said)."""

    def __init__(self, *, plan_gpu_nbytes: int, budget_nbytes: int, ask: Callable[[int], Placement | None],
                 adopt: Callable[[Placement], None], peak: Callable[[], int], reset_peak: Callable[[], None],
                 report: Callable[[str], None] = lambda line: None,
                 pools: Callable[[], StreamPools] | None = None):
        self.plan_gpu_nbytes, self.budget_nbytes = plan_gpu_nbytes, budget_nbytes
        self.ask, self.adopt, self.peak, self.reset_peak, self.report = ask, adopt, peak, reset_peak, report
        self.pools = pools
        self.started = False  # the first training forward began (the peak is measured from there)
        self.done = False
        self.chosen: Placement | None = None  # what was adopted (None: nothing yet, or nothing more fitted)

    def __call__(self, event: StepEvent) -> None:
        if self.done:
            return
        if event.kind == "begin":
            # A forward that records a graph ("train", or "grad-eval": a loop that trains in eval mode) may end in
            # a commit; an evaluation forward never does.
            if not self.started and event.signature != "eval":
                self.reset_peak()
                self.started = True
            return
        if event.kind != "commit" or not self.started:
            return
        self.done = True
        try:
            self._place()
        except Exception as error:  # the step stands; a change adopt_placement could not undo stops the next step
            self._say(logging.WARNING, f"auto placement after the first step failed ({error!r}); every update stays "
                                       "on the CPU")

    def _place(self) -> None:
        peak = self.peak()
        beyond = max(0, peak - self.plan_gpu_nbytes)
        reserve = supported_reserve(beyond, self.budget_nbytes)
        placement = self.ask(reserve)
        if placement is None:
            return
        measured = (f"the first step peaked at {approx_size(peak)} of the {approx_size(self.budget_nbytes)} GPU budget "
                    f"({approx_size(beyond)} beyond its plan{self._pools_now()})")
        if not (placement.gpu_update_fraction or placement.gpu_stream_fraction or placement.keep_for_backward_nbytes):
            self._say(logging.INFO, f"{measured}: with an activation reserve of {approx_size(reserve)} nothing more "
                                    "fits on the GPU; every update stays on the CPU")
            return
        try:
            self.adopt(placement)
        except (CapacityError, torch.OutOfMemoryError) as error:  # adopt_placement put everything back
            self._say(logging.WARNING, f"{measured}, but its placement could not be adopted ({error}); every update "
                                       "stays on the CPU")
            return
        self.chosen = placement
        self._say(logging.INFO, f"{measured}: activation reserve {approx_size(reserve)}, placement adopted")
        log.info("%s", "\n".join(placement.notes))

    def _pools_now(self) -> str:
        """``; held at the commit: 24.10 GiB for the compute stream (20.02 GiB of it free), 2.31 GiB for side
        streams (1.80 GiB free)`` (empty: not asked)."""
        if self.pools is None:
            return ""
        try:
            pools = self.pools()
        except Exception as error:  # a diagnostic: it must never cost the placement
            log.debug("reading the allocator's pools failed: %r", error)
            return ""
        return (f"; held at the commit: {approx_size(pools.own_nbytes)} for the compute stream "
                f"({approx_size(pools.own_free_nbytes)} of it free), {approx_size(pools.other_nbytes)} for side "
                f"streams ({approx_size(pools.other_free_nbytes)} free)")

    def _say(self, level: int, line: str) -> None:
        log.log(level, "%s", line)
        self.report(line)


def first_step_listener(listeners: Iterable[object]) -> FirstStepPlacement | None:
    """The session's ``FirstStepPlacement`` among a controller's step listeners (None: placed at ``offload()``)."""
    return next((listener for listener in listeners if isinstance(listener, FirstStepPlacement)), None)
