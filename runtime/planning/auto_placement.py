"""The ``auto`` values of ``optimizer.gpu_update_fraction``, ``optimizer.gpu_stream_fraction`` and
``prefetch.keep_for_backward``: chosen from the GPU budget, the model's block sizes and measured speeds.

What this module leaves out: it allocates nothing of the runtime's, registers nothing, times nothing and knows no
config file. :func:`choose_placement` is a pure function of its inputs (block sizes, budgets, a function giving the
memory plan's GPU bytes, and ``Rates``, which ``runtime.update.rates.measure_rates`` times once per process);
``runtime.planning.placement.resolve_plan`` puts them together before the plan is made.

The model, per optimizer step in steady state. ``N`` parameters in ``B`` blocks in forward order, prefix
sums ``c_0 = 0 .. c_B = N``. The first ``k`` blocks are updated on the GPU from resident state
(``gpu_update_fraction = c_k / N``), the next ``j`` are streamed (``S = c_{k+j} - c_k`` parameters), the
rest, ``H = N - c_{k+j}``, are updated by the CPU. Fractions are applied on whole blocks
(``runtime.planning.auto_placement.gpu_updated_blocks``), so only block boundaries are candidates.

- GPU memory. ``plan(k, j)``: the memory plan's GPU bytes (weight prefetch window, gradient assembly,
  streamed state in flight, resident weights and device-updated state). The activations are unknown until
  the first forward: by default the first step measures them (``runtime.planning.measured_placement`` asks this
  module again with the reserve its peak supports); where that is not done, a share of the budget is
  reserved for them: ``ACTIVATION_SHARE`` (three quarters) of what the plan with nothing on the GPU leaves
  free. The errors are not symmetric: a reserve that is too
  small fails the first step with an out-of-memory error, one that is too large costs only the speed the
  extra blocks would have brought. Half was too small: the 1.35B benchmark model at sequence 1024,
  micro-batch 8 needs about 20 GiB of activations, and under DeepSpeed ZeRO-2's reservation (31 GiB; H100,
  2026-11-26) half of the free budget left it out of memory in its first forward. A run whose activations
  need more sets ``tiers.gpu.activation_reserve`` (``runtime.planning.oom_hint`` names the figure when it runs out).
- ``k`` (auto): the most blocks whose plan, with the worst case of streamed state in flight (the largest
  remaining block, ``plan.STREAMED_IN_FLIGHT`` times), stays within budget minus the reserve. More ``k``
  shortens every term below, so the most that fits is the choice. When updates wait for the commit, the
  streamed state is counted within the budget but not beside the reserve: it comes in only in the room the
  backward frees (``_at_peak_nbytes``). On an H100 under DeepSpeed ZeRO-2's reservation (2026-11-27, 1.35B
  benchmark, weights resident, clipping) the best hand-set row peaked 1.7 GiB below its plan: the streamed
  state's 3 blocks.
- ``j`` (auto): the one that minimises ``max(T_cpu, T_h2d, T_d2h)`` (the fewest on a tie):
  ``T_cpu = H / adam_rate``, the rate timed while copies run each way (``Rates.adam_params_per_s``: in a
  step the copies share host memory's bandwidth with the kernel); ``T_h2d = (12 S + weights) / h2d_rate``,
  where weights are fetched for the forward and again for the backward (``fetch_itemsize`` bytes a
  parameter: 4 from an fp32 master cast on the GPU) except the blocks kept for backward, or, with weights
  resident, refreshed once from the fp32 master of the CPU-updated blocks (4 ``H``);
  ``T_d2h = (12 S + g H) / d2h_rate`` (streamed state written back, the CPU-updated blocks' gradients: ``g`` bytes a
  parameter, ``grad_itemsize``, 2 for bf16 host gradients, ``optimizer.host_grad_dtype``).
  0 when master or moments are not in pinned host memory.
  When updates wait for the commit (clipping, fp16 loss scaling) they all run after the backward, beside the
  next forward: the terms count what shares that window, the streamed state each way, the next forward's
  weight fetches (or the resident weights' refresh) and the CPU-updated blocks' gradients (fp32 ones held on the
  device until the commit and scaled there, ``runtime.engine.held_grads``; bf16 ones leave in the backward, but their
  updates still run after the commit), not the backward's fetches. On an H100 under DeepSpeed ZeRO-2's reservation
  with clipping (2026-11-27), counting them chose a fifth of the streaming the best hand-set row had, at 0.61 s a
  step against its 0.45. This is the case of steps that keep clipping; where the coefficient stays 1, host updates run early into second
  buffers during the backward (``runtime.update.speculation``) and the model overstates T_cpu, erring towards
  streaming more.
- keep (auto): the bytes of the last blocks of the forward (not device-updated) that fit in what the
  budget has left after ``plan(k, j)`` (``plan(k, 0)`` when updates wait for the commit: the streamed state
  comes after the kept weights are gone) and the reserve: whole blocks, as the controller keeps them; 0 with
  weights resident.

Not modelled: the forward and backward compute (unknown before a step runs, and the terms above overlap
it), both copy directions sharing the link (about 91 GB/s for both against 55 each way on the reference
box), the blocks the prefetch window holds over from forward to backward anyway, and NVMe traffic of spilled
moments. On the CPU the device is the CPU: every ``auto`` is 0.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from runtime.config.units import approx_size
from runtime.core.blocks import Block

log = logging.getLogger(__name__)

ACTIVATION_SHARE = 0.75  # of the GPU budget the plan with nothing device-updated leaves free (see the docstring)
STATE_ITEMSIZE = 12  # fp32 master + two moments, bytes a parameter
REFRESH_ITEMSIZE = 4  # a resident block's weights refreshed from its fp32 master

Auto = Literal["auto"]


@dataclass(frozen=True)
class Rates:
    """The speeds the chooser balances."""

    # The CPU AdamW update over the run's moments (optimizer.moment_dtype, and moment_kernel for int8) with the
    # optimizer's thread count, timed while copies run each way (as in a step)
    adam_params_per_s: float
    h2d_bytes_per_s: float  # host -> GPU copies from the host tier's memory (pinned unless tiers.host.pin is false)
    d2h_bytes_per_s: float  # GPU -> host
    adam_alone_params_per_s: float | None = None  # the same kernel with no copies running (None: not timed)

    def describe(self) -> str:
        """The rates for a person: ``CPU AdamW 3.10 G params/s beside copies (4.85 alone), PCIe H2D/D2H 55/55 GB/s``."""
        alone = "" if self.adam_alone_params_per_s is None else (
            f" beside copies ({self.adam_alone_params_per_s / 1e9:.2f} alone)")
        return (f"CPU AdamW {self.adam_params_per_s / 1e9:.2f} G params/s{alone}, PCIe H2D/D2H "
                f"{self.h2d_bytes_per_s / 1e9:.0f}/{self.d2h_bytes_per_s / 1e9:.0f} GB/s")


@dataclass(frozen=True)
class PlacementInputs:
    """What the chooser needs to know of the model, its placement and the GPU."""

    block_numels: tuple[int, ...]  # parameters of each block, in forward order
    gpu_budget_nbytes: int
    # (device-updated blocks, streamed blocks) -> the memory plan's GPU bytes with that many of each.
    gpu_plan_nbytes: Callable[[int, int], int]
    compute_itemsize: int  # bytes a parameter of the compute weights (what keep_for_backward counts)
    fetch_itemsize: int  # bytes a parameter of one weight fetch (4: the fp32 master, cast on the GPU)
    grad_itemsize: int = 4  # bytes a parameter of a host-updated block's gradient to host (optimizer.host_grad_dtype)
    weights_resident: bool = False  # placement.weights: gpu
    activation_reserve_nbytes: int | None = None  # tiers.gpu.activation_reserve; None: ACTIVATION_SHARE of what is free
    # Updates wait for the commit (clipping, fp16 loss scaling): what overlaps the CPU's updates is the step's end
    # (see step_times), not the backward.
    updates_wait_for_commit: bool = False
    no_stream_reason: str | None = None  # why no block may be streamed; None: streaming is possible
    state_itemsize: float = STATE_ITEMSIZE  # bytes a parameter of master and moments (optimizer.moment_dtype's)


@dataclass(frozen=True)
class StepTimes:
    """The modelled per-step seconds of the three resources that overlap the compute."""

    cpu_s: float
    h2d_s: float
    d2h_s: float
    # The three run after the backward (updates wait for the commit: clipping, fp16) rather than beside it.
    after_backward: bool = False

    @property
    def bound_s(self) -> float:
        """The slowest of the three: what the choice of ``gpu_stream_fraction`` minimises."""
        return max(self.cpu_s, self.h2d_s, self.d2h_s)

    def step_s(self, compute_s: float) -> float:
        """A step with ``compute_s`` of forward and backward: the three after it when they wait for the commit (the
        next forward they overlap is left out), else beside it."""
        return compute_s + self.bound_s if self.after_backward else max(compute_s, self.bound_s)

    def describe(self) -> str:
        """``T_cpu 0.09 s, T_h2d 0.11 s, T_d2h 0.10 s``."""
        return f"T_cpu {self.cpu_s:.3f} s, T_h2d {self.h2d_s:.3f} s, T_d2h {self.d2h_s:.3f} s"


@dataclass(frozen=True)
class Placement:
    """The three knobs resolved to numbers, and what ``auto`` chose and why (empty when nothing was auto)."""

    gpu_update_fraction: float
    gpu_stream_fraction: float
    keep_for_backward_nbytes: int
    notes: tuple[str, ...] = ()
    activation_reserve_nbytes: int = 0  # what the auto choices left for activations (0: nothing was auto on a GPU)
    host_sums: bool = False  # optimizer.accumulate_on resolved: micro-batch gradients summed in host memory
    rates: Rates | None = None  # the speeds the auto choices were made with (None: nothing auto on a GPU)
    times: StepTimes | None = None  # the modelled seconds a step of the chosen placement (None: nothing auto on a GPU)


def blocks_within(block_numels: Sequence[int], fraction: float) -> int:
    """How many first blocks hold at most ``fraction`` of the parameters (``runtime.planning.auto_placement.gpu_updated_blocks``
    selects them)."""
    if fraction <= 0:
        return 0
    limit = fraction * sum(block_numels) + 0.5
    return sum(1 for end in itertools.accumulate(block_numels) if end <= limit)


def step_times(inputs: PlacementInputs, rates: Rates, *, updated: int, streamed: int, kept_numel: int) -> StepTimes:
    """Modelled seconds a step of CPU AdamW and of copies each way, with the first ``updated`` blocks updated on
    the GPU, the next ``streamed`` streamed, and ``kept_numel`` parameters of weights kept for the backward."""
    prefix = [0, *itertools.accumulate(inputs.block_numels)]
    total, on_device = prefix[-1], prefix[updated]
    streamed_numel = prefix[updated + streamed] - on_device
    host_numel = total - prefix[updated + streamed]
    fetched = total - on_device
    if inputs.weights_resident:
        weights_nbytes = REFRESH_ITEMSIZE * host_numel
    elif inputs.updates_wait_for_commit:  # the next forward's fetches; the backward's run during the backward
        weights_nbytes = inputs.fetch_itemsize * fetched
    else:
        weights_nbytes = inputs.fetch_itemsize * (2 * fetched - kept_numel)
    # Waiting for the commit, the CPU-updated blocks' gradients count in that window too: fp32 ones wait on the
    # device and leave after it, scaled ([Note: held gradients] in runtime.engine.held_grads); narrower ones
    # (optimizer.host_grad_dtype) leave in the backward, but beside the same copies of the step's end.
    grads_nbytes = inputs.grad_itemsize * host_numel
    return StepTimes(cpu_s=host_numel / rates.adam_params_per_s,
                     h2d_s=(inputs.state_itemsize * streamed_numel + weights_nbytes) / rates.h2d_bytes_per_s,
                     d2h_s=(inputs.state_itemsize * streamed_numel + grads_nbytes) / rates.d2h_bytes_per_s,
                     after_backward=inputs.updates_wait_for_commit)


def activation_reserve_nbytes(inputs: PlacementInputs) -> int:
    """GPU bytes left for activations: ``tiers.gpu.activation_reserve`` when set, else ``ACTIVATION_SHARE`` of what
    the plan with nothing updated or streamed on the GPU leaves free of the budget."""
    if inputs.activation_reserve_nbytes is not None:
        return inputs.activation_reserve_nbytes
    return int(ACTIVATION_SHARE * max(0, inputs.gpu_budget_nbytes - inputs.gpu_plan_nbytes(0, 0)))


def _kept_blocks_numel(inputs: PlacementInputs, updated: int, room_nbytes: int) -> int:
    """Parameters of the longest run of last blocks (not device-updated) whose weights fit ``room_nbytes``: what
    the controller keeps from a forward for its backward under that budget."""
    kept = 0
    for numel in reversed(inputs.block_numels[updated:]):
        if (kept + numel) * inputs.compute_itemsize > room_nbytes:
            break
        kept += numel
    return kept


@dataclass(frozen=True)
class _Candidate:
    streamed: int
    kept_numel: int
    keep_nbytes: int
    times: StepTimes


def choose_placement(inputs: PlacementInputs, rates: Rates | None, *, update: float | Auto, stream: float | Auto,
                     keep: int | Auto) -> Placement:
    """Resolve the ``auto`` ones of the three knobs (see the module docstring for the model); explicit values are
    kept as they are. ``rates`` None: the device is the CPU, and every ``auto`` is 0."""
    if "auto" not in (update, stream, keep):
        return Placement(float(update), float(stream), int(keep))
    if rates is None:
        return _on_the_cpu(update, stream, keep)
    numels = inputs.block_numels
    prefix = [0, *itertools.accumulate(numels)]
    reserve = activation_reserve_nbytes(inputs)
    limit = inputs.gpu_budget_nbytes - reserve

    def update_fraction(updated: int) -> float:
        return prefix[updated] / prefix[-1] if update == "auto" else update

    def streamed_at_most(updated: int) -> int:
        if stream != "auto":  # counted from the update fraction in force, as gpu_streamed_blocks does
            return blocks_within(numels, update_fraction(updated) + stream) - updated
        return len(numels) - updated if inputs.no_stream_reason is None else 0

    updated = _most_updated(inputs, limit, streamed_at_most) if update == "auto" else blocks_within(numels, update)
    if stream != "auto" or inputs.no_stream_reason is not None:
        options = [streamed_at_most(updated)]
    else:  # every boundary whose state in flight fits (0 always: it needs nothing)
        options = [0, *(j for j in range(1, len(numels) - updated + 1) if _fits(inputs, updated, j, limit))]
    candidates = [_candidate(inputs, rates, updated, j, limit, keep) for j in options]
    best = min(candidates, key=lambda c: (c.times.bound_s, c.streamed))
    if stream != "auto":
        stream_fraction = float(stream)
    elif best.streamed:  # from the update fraction in force, so that the two end on the chosen block exactly
        stream_fraction = prefix[updated + best.streamed] / prefix[-1] - update_fraction(updated)
    else:
        stream_fraction = 0.0
    placement = Placement(update_fraction(updated), stream_fraction, best.keep_nbytes if keep == "auto" else int(keep))
    _check_block_counts(numels, placement, updated, best.streamed)
    notes = _notes(inputs, rates, placement, update=update, stream=stream, keep=keep, updated=updated, best=best,
                   reserve=reserve, baseline=candidates[0])
    return dataclasses.replace(placement, notes=notes, activation_reserve_nbytes=reserve, times=best.times)


def _on_the_cpu(update: float | Auto, stream: float | Auto, keep: int | Auto) -> Placement:
    """On the CPU the device is the CPU: every ``auto`` is 0, and the note says so."""
    chosen = [name for name, value in (("gpu_update_fraction", update), ("gpu_stream_fraction", stream),
                                       ("keep_for_backward", keep)) if value == "auto"]
    return Placement(0.0 if update == "auto" else update, 0.0 if stream == "auto" else stream,
                     0 if keep == "auto" else int(keep),
                     (f"auto placement: the device is the CPU: {', '.join(chosen)} 0 (nothing to place on a GPU)",))


def _most_updated(inputs: PlacementInputs, limit: int, streamed_at_most: Callable[[int], int]) -> int:
    """The most first blocks whose resident state fits ``limit`` beside the rest of the plan and the most streamed
    state that may be in flight with them; failing that (a budget too tight to stream the largest blocks at all),
    beside none: the stream fraction then takes only what fits."""
    counts = range(len(inputs.block_numels), -1, -1)
    fits = next((k for k in counts if _fits(inputs, k, streamed_at_most(k), limit)), None)
    if fits is None:
        fits = next((k for k in counts if _fits(inputs, k, 0, limit)), 0)
    return fits


def _at_peak_nbytes(inputs: PlacementInputs, updated: int, streamed: int) -> int:
    """The plan's GPU bytes held beside the activations at their peak. When updates wait for the commit, streamed
    state comes in only under the memory in use at the forward's end (``DeviceUpdates.stream_in_order``: the room the
    backward frees) and at the commit: it takes the activations' room, not room beside them."""
    return inputs.gpu_plan_nbytes(updated, 0 if inputs.updates_wait_for_commit else streamed)


def _fits(inputs: PlacementInputs, updated: int, streamed: int, limit: int) -> bool:
    """The plan fits: what it holds at the activations' peak within ``limit`` (budget less reserve), all of it
    within the budget."""
    return (_at_peak_nbytes(inputs, updated, streamed) <= limit
            and inputs.gpu_plan_nbytes(updated, streamed) <= inputs.gpu_budget_nbytes)


def _candidate(inputs: PlacementInputs, rates: Rates, updated: int, streamed: int, limit: int,
               keep: int | Auto) -> _Candidate:
    if keep != "auto":
        kept_numel = 0 if inputs.weights_resident else _kept_blocks_numel(inputs, updated, int(keep))
        keep_nbytes = int(keep)
    elif inputs.weights_resident:
        kept_numel = keep_nbytes = 0
    else:
        room = limit - _at_peak_nbytes(inputs, updated, streamed)
        kept_numel = _kept_blocks_numel(inputs, updated, max(0, room))
        keep_nbytes = kept_numel * inputs.compute_itemsize
    times = step_times(inputs, rates, updated=updated, streamed=streamed, kept_numel=kept_numel)
    return _Candidate(streamed, kept_numel, keep_nbytes, times)


def _check_block_counts(numels: Sequence[int], placement: Placement, updated: int, streamed: int) -> None:
    """The fractions must select exactly the chosen blocks when the controller applies them."""
    got_updated = blocks_within(numels, placement.gpu_update_fraction)
    got_streamed = blocks_within(numels, placement.gpu_update_fraction + placement.gpu_stream_fraction) - got_updated
    if placement.gpu_stream_fraction <= 0:
        got_streamed = 0
    if (got_updated, got_streamed) != (updated, streamed):
        raise RuntimeError(f"auto placement chose {updated} device-updated and {streamed} streamed blocks, but its "
                           f"fractions select {got_updated} and {got_streamed}")


def _notes(inputs: PlacementInputs, rates: Rates, placement: Placement, *, update: float | Auto,
           stream: float | Auto, keep: int | Auto, updated: int, best: _Candidate, reserve: int,
           baseline: _Candidate) -> tuple[str, ...]:
    """The plan's two lines: the memory side (update fraction, keep), then the time side (stream fraction)."""
    def how(value: object) -> str:
        return "" if value == "auto" else "set; "

    blocks = len(inputs.block_numels)
    state_nbytes = int(inputs.state_itemsize * sum(inputs.block_numels[:updated]))
    keep_nbytes = placement.keep_for_backward_nbytes
    reserve_set = " (set)" if inputs.activation_reserve_nbytes is not None else ""
    memory = (f"auto placement: gpu_update_fraction {placement.gpu_update_fraction:.2f} ({how(update)}first {updated} of "
              f"{blocks} blocks, {approx_size(state_nbytes)} of master + moments; GPU budget "
              f"{approx_size(inputs.gpu_budget_nbytes)}, activation reserve {approx_size(reserve)}{reserve_set}), "
              f"keep_for_backward {approx_size(keep_nbytes) if keep_nbytes else 0}{'' if keep == 'auto' else ' (set)'}")
    if stream != "auto":
        why = "set; "
    elif inputs.no_stream_reason is not None:
        why = f"{inputs.no_stream_reason}; "
    elif updated == blocks:
        why = "every block is updated on the GPU; "
    else:
        why = ""
    at_zero = f"; {baseline.times.bound_s:.3f} s at 0" if best.streamed and stream == "auto" else ""
    timing = (f"  gpu_stream_fraction {placement.gpu_stream_fraction:.2f} ({why}{rates.describe()}: "
              f"{best.times.describe()} a step{at_zero})")
    return memory, timing


def gpu_streamed_blocks(blocks: list[Block], update_fraction: float, stream_fraction: float) -> frozenset[int]:
    """The blocks right after the device-updated ones (in forward order), holding at most ``stream_fraction``
    of the parameters: their update is the next hardest for the CPU to hide."""
    if stream_fraction <= 0:
        return frozenset()
    both = gpu_updated_blocks(blocks, update_fraction + stream_fraction)
    return both - gpu_updated_blocks(blocks, update_fraction)

def gpu_updated_blocks(blocks: list[Block], fraction: float) -> frozenset[int]:
    """The first blocks in forward order holding at most ``fraction`` of the parameters: their gradients
    arrive last in backward and their weights are needed first in the next forward, so they are the
    updates a CPU optimizer cannot hide."""
    ordered = sorted(blocks, key=lambda b: b.index)
    return frozenset(b.index for b in ordered[: blocks_within([b.numel for b in ordered], fraction)])
