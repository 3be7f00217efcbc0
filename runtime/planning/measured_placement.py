"""Auto placement chosen from the first step's measured GPU peak, not from a guessed activation reserve.

``auto`` placement (``runtime.planning.auto_placement``) must leave room for activations it cannot see before a step runs.
A share of the free budget is wrong both ways: under DeepSpeed ZeRO-2's reservation (31 GiB on an H100) the
1.35B benchmark's first step reached 25.1 GiB beyond its plan (reserved bytes, weights resident; call Z3 in
docs/measurements-history.md) and three quarters of the free budget left its first forward out of memory, while the
8B scenario under a 24 GiB cap used half of what was reserved. So when
``optimizer.gpu_update_fraction`` and ``tiers.gpu.activation_reserve`` are both ``auto`` on a GPU, the session's
first step runs with every update on the CPU, and nothing streamed or kept for backward where those are ``auto``
(the plan's smallest GPU footprint, shown by ``tierstore plan``); at its commit the peak it reached is read, auto placement
is asked again with the reserve that peak supports (``runtime.planning.peak_hint.supported_reserve``: the bytes beyond
the plan plus a margin), and the first blocks it chooses move their master and moments to the GPU
(``Controller.adopt_placement``). The log (and the session's plan notes) say what was measured and chosen.

The peak is the allocator's reserved bytes, not the allocated ones: a memory-fraction cap limits the former, and
the difference is the fragmentation the step itself caused; but under expandable segments, whose cache the
allocator unmaps and maps again wherever an allocation needs it, the allocated peak
(``runtime.planning.peak_hint.cuda_step_peak``: at 8B the held peak was 16.1 GiB against 9.8 allocated, and only the
latter put anything on the GPU). Under an 8 GiB cap (H100, 2026-11-27) a reserve
from the allocated peak left the second step 0.75 GiB short. With weights fetched from host the reserved peak
was 2-3 GiB above the allocated one on the benchmark model under ZeRO-2's memory (calls Z2, Z3), enough that auto
placement could not afford the hand-set row's keep_for_backward; the line also says what the allocator holds
at the commit for the compute stream and for side streams and how much of each is cached free (a side stream's
cache serves only that stream), to tell how much of such a difference is such a cache (calls K1-K4, weights
resident: side streams held 260-320 MiB, the compute stream 26-28 GiB, most of it cached free). Fetched weights
have come from the compute stream's pool since [Note: weights in the compute stream's pool] (runtime.engine.weights).

With ``placement.activations: auto`` (``RecomputeTrial``) a first step whose placement does not put every block's
update on the GPU (some streamed or left to the CPU) is followed by a second measured step with the layers'
forwards recomputed in the backward (``runtime.model.recompute``), its updates still on the CPU; at its commit auto
placement is asked at the reserve that step supports, and the faster of the two placements by the time model is
adopted, recomputation staying on only with its own: ``StepTimes.step_s`` of each (``Placement.times``) over a
compute of three forwards kept, four recomputed, the forward being the layers' as ``ForwardTimer`` timed them,
each layer's least over the two measured steps (the embedding, head and loss are left out, which errs towards
the smaller CPU and copy terms, recomputation's, where those overlap the compute). A measured step that is dropped (``zero_grad()`` before
``step()``, a caught exception) is measured again from the next training forward.

A first-step plan that sums micro-batch gradients in host memory or spills moments to NVMe (the 8B scenario's) is
measured too: the blocks moved to the GPU sum their gradients on the device from then on (``HostGradSums.release``),
and the pinned memory their master, moments and host gradient leave brings spilled moments back from NVMe, as
many as the plan for the adopted placement fits in the pinned arena (``runtime.planning.block_plan.spilled_after``), the staging
room of the blocks left on NVMe kept free (``runtime.engine.spill_return``). Such a session streams nothing: a
streamed block's moments must be in pinned memory.

What it leaves out: accumulated steps that may fetch a compute-dtype copy of the weights where the first step's plan
spills nothing (chosen for the first step, the copy would rule out streaming): they keep the placement chosen at
offload, with the share-based reserve; giving memory back to the host (the pinned arena was sized for the first step's plan, where every
update runs on the CPU); and a later step that needs more memory than the first one (longer sequences: the
margin covers some, ``runtime.planning.oom_hint`` names the setting when it does not). Steps before the first training
step (an evaluation) are not measured: the allocator's cache is emptied and the process's peak statistics are
reset when the first forward that records a graph begins (``torch.cuda.reset_peak_memory_stats``: a user's own
peak figures restart there too). The bytes moved to the GPU are not transfer events (the profiler's traffic
counts them not).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from runtime.config.units import approx_size
from runtime.core.events import StepEvent
from runtime.planning.auto_placement import Placement
from runtime.planning.peak_hint import StreamPools, supported_reserve
from tierstore import CapacityError

log = logging.getLogger(__name__)

FIRST_STEP_NOTE = ("auto placement: chosen from the first step's measured GPU peak (runtime.planning.measured_placement): "
                   "the first step updates on the CPU, streaming and keeping nothing where those are auto; the "
                   "GPU's share follows")
COMPUTE_PER_FORWARD = 3  # a step's forward and backward, in forwards (a backward costs about two)
TRIAL_NOTE = ("placement.activations auto: where the first step's state does not all fit on the GPU beside its "
              "activations, the second step recomputes the layers' forwards in the backward and is measured too; the "
              "faster placement of the two by the time model is adopted")


class LayerRecompute(Protocol):
    """The layers' recomputation as the trial switches it (``runtime.model.recompute.Recompute``)."""

    def turn_on(self) -> None:
        """Recompute the layers' forwards in the backward from the next forward on."""

    def undo(self) -> None:
        """Give every layer its own forward back."""


class LayerTimer(Protocol):
    """The layers' forwards timed over the measured steps (``runtime.model.recompute.ForwardTimer``)."""

    def next_step(self) -> None:
        """A measured step begins: its forwards are timed as a new step."""

    def drop_step(self) -> None:
        """The step under way was dropped: its timings are forgotten."""

    def seconds(self) -> float:
        """The layers' forward, each layer's least over the measured steps."""

    def remove(self) -> None:
        """Take the timer's hooks off the layers."""


class LayerBuffers(Protocol):
    """A watch on the layers' buffers (``runtime.model.recompute.BufferWatch``)."""

    def mark(self) -> None:
        """Remember the buffers as they are now."""

    def changed(self) -> str | None:
        """The first buffer changed since ``mark`` (None: none)."""


@dataclass
class RecomputeTrial:
    """What ``placement.activations: auto`` gives the first-step placement: the layers' recomputation to try in
    a second measured step, the timer of their forwards (what recomputing costs), whether the model checkpoints
    its layers itself (seen recomputing, or flagged, perhaps since offload(): nothing to try), and a watch on the
    layers' buffers (a forward that changes them must not run twice)."""

    recompute: LayerRecompute
    timer: LayerTimer
    checkpoints_itself: Callable[[], bool]
    buffers: LayerBuffers

    def close(self, keep_on: bool) -> None:
        """The trial is over: the timer's hooks come off, recomputation stays on only when chosen."""
        self.timer.remove()
        if not keep_on:
            self.recompute.undo()


@dataclass(frozen=True)
class _Measured:
    placement: Placement
    reserve: int
    line: str  # "the first step peaked at ... (... beyond its plan...)"


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
    (``runtime.planning.peak_hint.cuda_reserved_by_stream``), said in the line: side streams hold the fetch or refresh staging and
    a cache only they can use, part of a peak beyond the plan that activations never took (None: not said);
    ``peak_what``: what ``peak`` counts, said after its figure (``runtime.planning.peak_hint.cuda_step_peak``; None: not said);
    ``trial``: recomputation of the layers' activations to try when the first step's state does not all fit
    (``placement.activations: auto``; None: activations are kept)."""

    def __init__(self, *, plan_gpu_nbytes: int, budget_nbytes: int, ask: Callable[[int], Placement | None],
                 adopt: Callable[[Placement], None], peak: Callable[[], int], reset_peak: Callable[[], None],
                 report: Callable[[str], None] = lambda line: None,
                 pools: Callable[[], StreamPools] | None = None, trial: RecomputeTrial | None = None,
                 peak_what: Callable[[], str] | None = None):
        self.plan_gpu_nbytes, self.budget_nbytes = plan_gpu_nbytes, budget_nbytes
        self.peak_what = peak_what
        self.ask, self.adopt, self.peak, self.reset_peak, self.report = ask, adopt, peak, reset_peak, report
        self.pools = pools
        self.trial = trial
        self.started = False  # the measured step's first training forward began (the peak is measured from there)
        self.done = False
        self.chosen: Placement | None = None  # what was adopted (None: nothing yet, or nothing more fitted)
        self._kept: _Measured | None = None  # the first step's outcome, while the second tries recomputation
        self._signature = ""  # the measured step's: "train", or "grad-eval" (trained in eval mode)
        self.measured_steps = 0  # steps run as measured (1, or 2 with a recompute trial): not yet placed
        # optimizer step -> seconds its commit spent placing (the profiler leaves them out of every step's time)
        self.placing_s: dict[int, float] = {}

    def __call__(self, event: StepEvent) -> None:
        if self.done:
            return
        if event.kind == "drop":  # the measured step was dropped: measure the next one from its start
            # Between the measured steps (no step under way: an evaluation forward that raised) the first step's
            # forwards stay timed.
            if self.started and self.trial is not None:
                self.trial.timer.drop_step()
            self.started = False
            return
        if event.kind == "begin":
            # A forward that records a graph ("train", or "grad-eval": a loop that trains in eval mode) may end in
            # a commit; an evaluation forward never does.
            if not self.started and event.signature != "eval":
                self.started, self._signature = True, event.signature
                self.reset_peak()
                if self.trial is not None:
                    try:
                        self.trial.timer.next_step()  # each layer's least over the measured steps
                        self.trial.buffers.mark()
                    except Exception as error:  # the trial's own helpers: no trial, the placement goes on
                        self._end_trial(keep_on=False)
                        log.warning("placement.activations auto: no recompute trial (%r)", error)
            return
        if event.kind != "commit" or not self.started:
            return
        self.measured_steps += 1
        self.done = True
        start = time.perf_counter()
        try:
            self._place()
        except Exception as error:  # the step stands; a change adopt_placement could not undo stops the next step
            self.done, self._kept = True, None
            self._end_trial(keep_on=False)
            self._say(logging.WARNING, f"auto placement after the first step failed ({error!r}); the updates stay "
                                       "where they ran, unless the failure stopped the session (the next step then "
                                       "says so)")
        finally:
            self.placing_s[event.step] = time.perf_counter() - start

    def close(self) -> None:
        """The session closes: a trial under way ends (its timer's hooks come off, recomputation is undone)."""
        self.done = True
        self._end_trial(keep_on=False)

    def _measure(self, which: str) -> _Measured | None:
        """Auto placement at the reserve the measured step's peak supports (None: the session is gone)."""
        peak = self.peak()
        beyond = max(0, peak - self.plan_gpu_nbytes)
        reserve = supported_reserve(beyond, self.budget_nbytes)
        placement = self.ask(reserve)
        if placement is None:
            return None
        what = f" {self.peak_what()}" if self.peak_what is not None else ""
        return _Measured(placement, reserve, f"the {which} step peaked at {approx_size(peak)}{what} of the "
                                             f"{approx_size(self.budget_nbytes)} GPU budget ({approx_size(beyond)} "
                                             f"beyond its plan{self._pools_now()})")

    def _place(self) -> None:
        outcome = self._measure("second" if self._kept is not None else "first")
        if outcome is None:
            self._end_trial(keep_on=False)
            return
        if self._kept is None and self._worth_a_trial(outcome.placement) and self._trial_started(outcome):
            self._kept, self.done, self.started = outcome, False, False
            self._say(logging.INFO, f"{outcome.line}: with an activation reserve of {approx_size(outcome.reserve)} "
                                    f"{_on_the_gpu(outcome.placement)}; the second step recomputes the layers' "
                                    "activations in the backward (placement.activations: auto) to measure what that "
                                    "frees, its updates still on the CPU")
            return
        recomputed, verdict = False, ""
        if self._kept is not None and self.trial is None:
            # The trial ended as the second step began (its helpers failed): that step kept its activations too,
            # and its own measurement places it.
            verdict = "activations kept (placement.activations: auto): the recompute trial ended before its step"
        elif self._kept is not None:
            chosen, verdict = self._choose(self._kept, outcome)
            recomputed, outcome = chosen is outcome, chosen
        placement, reserve, measured = outcome.placement, outcome.reserve, outcome.line
        if not (placement.gpu_update_fraction or placement.gpu_stream_fraction or placement.keep_for_backward_nbytes):
            self._end_trial(keep_on=False)
            self._say_verdict(verdict)
            self._say(logging.INFO, f"{measured}: with an activation reserve of {approx_size(reserve)} nothing more "
                                    "fits on the GPU; every update stays on the CPU")
            return
        try:
            self.adopt(placement)
        except (CapacityError, torch.OutOfMemoryError) as error:  # adopt_placement put everything back
            kept = self._kept
            if not (recomputed and kept is not None):
                self._end_trial(keep_on=False)
                self._say_verdict(verdict)
                self._say(logging.WARNING, f"{measured}, but its placement could not be adopted ({error}); every "
                                           "update stays on the CPU")
                return
            # The recomputed placement did not fit after all: the first step's may, with the activations kept.
            verdict += (f"; but that placement could not be adopted ({error}), so the first step's is, activations "
                        "kept")
            recomputed = False
            placement, reserve, measured = kept.placement, kept.reserve, kept.line
            try:
                self.adopt(placement)
            except (CapacityError, torch.OutOfMemoryError) as again:
                self._end_trial(keep_on=False)
                self._say_verdict(verdict)
                self._say(logging.WARNING, f"{measured}, but its placement could not be adopted ({again}); every "
                                           "update stays on the CPU")
                return
        self._end_trial(keep_on=recomputed)
        self.chosen = placement
        self._say_verdict(verdict)  # after adopt: the plan's notes it replaced keep the line
        self._say(logging.INFO, f"{measured}: activation reserve {approx_size(reserve)}, placement adopted")
        log.info("%s", "\n".join(placement.notes))

    def _worth_a_trial(self, placement: Placement) -> bool:
        """Recomputation may pay: the state does not all fit on the GPU beside the measured activations, the step
        trained in train mode, the model does not checkpoint its layers itself, and their forwards changed no
        buffer."""
        if self.trial is None:
            return False
        # Recomputation acts on training forwards only: a loop that trains in eval mode has nothing to try.
        if placement.gpu_update_fraction >= 1 or placement.times is None or self._signature != "train":
            self._end_trial(keep_on=False)
            return False
        try:
            why_not = ("the model checkpoints its layers itself" if self.trial.checkpoints_itself() else None)
            changed = self.trial.buffers.changed()
        except Exception as error:  # the trial's own checks: no trial, the first step's placement goes on
            why_not, changed = f"its checks failed ({error!r})", None
        if changed is not None:
            why_not = f"the layers' forward changed a buffer ({changed}), which a recomputed forward would change again"
        if why_not is not None:
            self._end_trial(keep_on=False)
            self._say(logging.INFO, f"placement.activations auto: activations kept, not tried: {why_not}")
            return False
        return True

    def _trial_started(self, outcome: _Measured) -> bool:
        """Turn recomputation on for the second step; where that fails, the first step's placement stands."""
        try:
            self.trial.recompute.turn_on()  # type: ignore[union-attr]  # called after _worth_a_trial
        except Exception as error:
            self._end_trial(keep_on=False)
            self._say(logging.WARNING, f"placement.activations auto: the layers could not be recomputed ({error!r}); "
                                       "activations kept")
            return False
        return True

    def _choose(self, kept: _Measured, recomputed: _Measured) -> tuple[_Measured, str]:
        """The faster of the two measured steps' placements by the time model, and the line that says why. The
        layers' forward ``F`` is timed in both measured steps (each layer's least: ``ForwardTimer``); the step's
        forward and backward are taken as ``3 F`` (a backward costs about two forwards) and the recomputed one as
        ``4 F``: each placement's terms then follow the compute when updates wait for the commit, else overlap it
        (``StepTimes.step_s``)."""
        forward_s = self.trial.timer.seconds()  # type: ignore[union-attr]  # a second step runs only with a trial
        compute_s = COMPUTE_PER_FORWARD * forward_s
        keep_s = kept.placement.times.step_s(compute_s) if kept.placement.times else float("inf")
        recompute_s = (recomputed.placement.times.step_s(compute_s + forward_s) if recomputed.placement.times
                       else float("inf"))
        chosen = recomputed if recompute_s < keep_s else kept
        verdict = ("activations recomputed (placement.activations: auto; set it to recompute to skip this trial in "
                   "a later run)" if chosen is recomputed
                   else "activations kept (placement.activations: auto): recomputing them does not pay (set it to "
                        "keep to skip this trial in a later run)")
        return chosen, (f"{recomputed.line} with the layers recomputed, where {kept.line} keeping their "
                        f"activations: recomputed, {_on_the_gpu(recomputed.placement)} for a modelled "
                        f"{recompute_s:.3f} s a step (the layers' forward timed at {forward_s:.3f} s, run twice); "
                        f"kept, {_on_the_gpu(kept.placement)} for {keep_s:.3f} s: {verdict}")

    def _say_verdict(self, verdict: str) -> None:
        if verdict:
            self._say(logging.INFO, verdict)

    def _end_trial(self, *, keep_on: bool) -> None:
        if self.trial is not None:
            trial, self.trial = self.trial, None
            trial.close(keep_on)

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


def _on_the_gpu(placement: Placement) -> str:
    """``gpu_update_fraction 0.09, gpu_stream_fraction 0.49``: the shares of the update a placement puts on the GPU."""
    return (f"gpu_update_fraction {placement.gpu_update_fraction:.2f}, gpu_stream_fraction "
            f"{placement.gpu_stream_fraction:.2f}")


def first_step_listener(listeners: Iterable[object]) -> FirstStepPlacement | None:
    """The session's ``FirstStepPlacement`` among a controller's step listeners (None: placed at ``offload()``)."""
    return next((listener for listener in listeners if isinstance(listener, FirstStepPlacement)), None)
