"""What a training step's measured GPU peak says about auto placement's activation reserve.

``auto`` placement (``runtime.planning.auto_placement``) keeps a reserve for activations it cannot know before the first
forward; in sessions placed at ``offload()`` (those ``runtime.planning.measured_placement`` does not re-place after their
first step) it is three quarters of what the plan leaves free. On a card with room to spare that is often far more
than the step uses (the 8B scenario under a 24 GiB cap, before measured placement covered it: 10.1 GiB reserved,
its first step peaked with about 5 GiB of activations), and the state that could have been updated on the GPU stays in host memory, where it
pushes moments out to NVMe. After the first steps this module compares their peak with the plan and, when
a lower reserve would put more blocks on the GPU, logs the setting and what auto placement chooses with it
(asked, with the rates it was chosen with, not re-derived). The profiler's advice uses the same figures.

The reserve the peak supports: the peak's bytes beyond the plan (what the activations really took, the
plan's over-count netted out; weights kept for backward by ``auto`` counted in neither, since auto placement
fills the room with them again, a hand-set keep counted as the activations' room) plus ``GPU_MARGIN`` of the
budget, rounded up to a quarter GiB.

What it leaves out: changing anything in the running session (the sessions it listens to keep the placement
chosen at ``offload()``; the log names the setting for the next run), runs whose update fraction or reserve is
hand-set, and fragmentation (the peak is allocated bytes; a memory-fraction cap applies to reserved ones: the
margin may not cover it, see ``runtime.planning.measured_placement``). ``supported_reserve`` is shared with
``runtime.planning.measured_placement``, which reads the reserved peak (the allocated one under expandable segments:
``cuda_step_peak``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.config.units import approx_size
from runtime.core.blocks import Block
from runtime.core.events import StepEvent
from runtime.core.text import counted
from runtime.planning.auto_placement import Placement, gpu_streamed_blocks, gpu_updated_blocks

log = logging.getLogger(__name__)

# Of the GPU budget, left free beyond a measured peak when more state goes onto the GPU. On an H100 under DeepSpeed
# ZeRO-2's 31.06 GiB reservation (2026-11-27, the 1.35B benchmark with clipping) the best hand-set rows peaked at
# 28.6-28.8 GiB allocated, 2.3-2.5 GiB to spare; with a margin of 10% (3.1 GiB) the placement measured from the
# first step kept every update on the CPU with weights resident and one block on the GPU with weights on host
# (call Z1 in docs/measurements-history.md).
GPU_MARGIN = 0.05
QUARTER_GIB = 1 << 28


def supported_reserve(beyond_plan_nbytes: int, budget_nbytes: int) -> int:
    """The activation reserve a measured peak supports: its bytes beyond the plan plus ``GPU_MARGIN`` of the
    budget, rounded up to a quarter GiB (``runtime.planning.measured_placement`` uses it too)."""
    return -(-int(beyond_plan_nbytes + GPU_MARGIN * budget_nbytes) // QUARTER_GIB) * QUARTER_GIB


def beyond_plan(config: dict[str, Any], peak_nbytes: int) -> int:
    """What a measured GPU peak held beyond the memory plan (``config["gpu_plan_nbytes"]``) and, under automatic
    ``keep_for_backward``, beyond the activations kept for backward: the other activations and the allocator's
    slack, what grows with the micro-batch."""
    keep = int(config.get("keep_for_backward_nbytes", 0)) if config.get("keep_auto") else 0
    return max(0, peak_nbytes - int(config.get("gpu_plan_nbytes", 0)) - keep)


def reserve_probe(config: dict[str, Any], peak_nbytes: int | None, blocks: Sequence[Block],
                  ask: Callable[[int], Placement | None]) -> dict[str, Any] | None:
    """The reserve ``peak_nbytes`` supports and what auto placement (``ask(reserve)``; None: it cannot be asked
    any more) chooses with it, for a session described by ``config`` (``runtime.session.placement_figures``). None
    with a hand-set update fraction, without a peak or reserve, or when the reserve would not fall. The
    baseline is auto placement asked again at the reserve it has, so the two counts differ by the reserve
    alone (not by a budget or a gradient-sum choice read again later)."""
    if peak_nbytes is None or not config.get("gpu_update_fraction_auto") or not config.get("activation_reserve_nbytes"):
        return None
    if config.get("measured_first_step"):  # its reserve came from the reserved peak: an allocated one would undercut it
        return None
    beyond = beyond_plan(config, peak_nbytes)
    reserve = supported_reserve(beyond, int(config["gpu_budget_nbytes"]))
    if reserve >= config["activation_reserve_nbytes"]:
        return None
    placement, baseline = ask(reserve), ask(int(config["activation_reserve_nbytes"]))
    if placement is None or baseline is None:
        return None
    blocks = list(blocks)
    return {"reserve_nbytes": reserve, "beyond_plan_nbytes": beyond,
            "baseline_updated": len(gpu_updated_blocks(blocks, baseline.gpu_update_fraction)),
            "updated": len(gpu_updated_blocks(blocks, placement.gpu_update_fraction)),
            "streamed": len(gpu_streamed_blocks(blocks, placement.gpu_update_fraction, placement.gpu_stream_fraction)),
            "keep_for_backward_nbytes": placement.keep_for_backward_nbytes}


class PeakHint:
    """A controller step listener: after ``after_steps`` committed steps (the peak only grows; the second step is
    the first whose forward overlaps a previous step's write-backs), the log line ``reserve_probe`` supports,
    once. ``peak``: the process's peak GPU bytes now; ``config``: ``runtime.session.placement_figures``. Silent
    when the reserve was set by hand (the user chose it, perhaps on an out-of-memory hint), and when the steps
    stayed below the peak setup reached (a model built on the GPU before ``offload()``, or peak statistics
    reset since, hide it)."""

    def __init__(self, config: dict[str, Any], blocks: Sequence[Block], ask: Callable[[int], Placement | None],
                 peak: Callable[[], int], after_steps: int = 2):
        self.config, self.blocks, self.ask, self.peak, self.after_steps = config, blocks, ask, peak, after_steps
        self.peak_at_setup = peak()
        self.done = not config.get("activation_reserve_auto", True)

    def __call__(self, event: StepEvent) -> None:
        if self.done or event.kind != "commit" or event.step < self.after_steps:
            return
        self.done = True
        peak = self.peak()
        if peak <= self.peak_at_setup:  # the steps stayed below what setup reached: their own peak is unknown
            return
        probe = reserve_probe(self.config, peak, self.blocks, self.ask)
        if probe is None or probe["updated"] <= probe["baseline_updated"]:
            return
        log.info("the first %s peaked at %s of the %s GPU budget (%s beyond the plan): for the next run on "
                 "this budget, tiers.gpu.activation_reserve: %s (auto: %s) would update %d more block(s) on the GPU, "
                 "whose state then leaves host memory (a profile's advice, tierstore train --profile DIR or "
                 "runtime.profiler.Profiler, says what it would save)",
                 counted(event.step, "step"), approx_size(peak), approx_size(self.config["gpu_budget_nbytes"]),
                 approx_size(probe["beyond_plan_nbytes"]), approx_size(probe["reserve_nbytes"]),
                 approx_size(self.config["activation_reserve_nbytes"]), probe["updated"] - probe["baseline_updated"])


def cuda_peak_reset(device: torch.device) -> Callable[[], None]:
    """Empty the allocator's cache and reset the peak statistics on ``device``, as a callable: the reserved peak then
    counts what the steps hold, not blocks cached before them (a model built on the GPU, setup's staging)."""

    def reset() -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    return reset


def cuda_peak(device: torch.device) -> Callable[[], int]:
    """The process's peak allocated bytes on ``device`` (``torch.cuda.max_memory_allocated``), as a callable."""
    return lambda: int(torch.cuda.max_memory_allocated(device))


@dataclass(frozen=True)
class StreamPools:
    """Bytes the caching allocator holds on a device: for the current (compute) stream and for every other
    stream, and of each the part cached free (held, not allocated)."""

    own_nbytes: int
    own_free_nbytes: int
    other_nbytes: int
    other_free_nbytes: int


def cuda_reserved_by_stream(device: torch.device) -> Callable[[], StreamPools]:
    """What the caching allocator holds on ``device`` now, split by stream (``StreamPools``), as a callable.
    Memory cached for one stream serves only that stream: blocks a side stream allocated (the fetch staging, the
    refresh staging of resident weights) and freed stay reserved beside the compute stream's, a part of a reserved
    peak beyond the plan that activations never used. Read from ``torch.cuda.memory_snapshot`` (a pass
    over every segment)."""
    index = device.index if device.index is not None else torch.cuda.current_device()

    def read() -> StreamPools:
        current = torch.cuda.current_stream(index).cuda_stream
        held = {True: [0, 0], False: [0, 0]}  # current stream or not -> [total, free]
        for segment in torch.cuda.memory_snapshot():
            if segment.get("device") != index:
                continue
            pool = held[segment.get("stream") == current]
            pool[0] += int(segment["total_size"])
            pool[1] += int(segment["total_size"]) - int(segment.get("allocated_size", 0))
        return StreamPools(held[True][0], held[True][1], held[False][0], held[False][1])

    return read


def expandable_segments(device: torch.device) -> bool:
    """True when CUDA's caching allocator maps its memory on ``device`` in expandable segments
    (``expandable_segments:True`` in ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF``, as ``examples/finetune_8b.py``
    sets): memory it holds cached and free is unmapped and mapped again wherever an allocation needs it (the
    allocator retries after freeing its cache), so what a step needs under a memory-fraction cap is its allocated
    peak, not the peak it held. Read from the allocator's segments (``torch.cuda.memory_snapshot``: what is in
    effect); before it holds any, from the settings."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    flags = [segment["is_expandable"] for segment in torch.cuda.memory_snapshot()
             if segment.get("device") == index and "is_expandable" in segment]
    if flags:
        return any(flags)
    settings = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    read = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # the last settings parsed (torch 2.13)
    if not settings and read is not None:
        settings = read()
    return re.search(r"expandable_segments\s*:\s*true", settings, re.IGNORECASE) is not None


def cuda_step_peak(device: torch.device) -> tuple[Callable[[], int], Callable[[], str]]:
    """The peak a measured step is placed from (``runtime.planning.measured_placement``) and what its last reading counted
    (said after the figure), as callables; the peak decides when the step is measured: the bytes the allocator held
    (``cuda_reserved_peak``: a memory-fraction cap limits those, and without expandable segments cached blocks split
    by other sizes may never serve an activation) or, under expandable segments, the allocated bytes (``cuda_peak``),
    since the cache goes back wherever needed. On the 8B scenario's first step (H100, 24 GiB cap, expandable
    segments) the two were 9.8 and 16.1 GiB: from the held peak nothing more fitted on the GPU; from the allocated
    one the embedding and a layer did, as a hand-set 6 GiB reserve had placed them (steps at 20.8 GiB allocated,
    24.0 held, the allocator freeing its cache and retrying a few times a step)."""
    allocated, held = cuda_peak(device), cuda_reserved_peak(device)
    read = ["held by the allocator"]  # what the last peak() counted (one pass over the segments decides both)

    def peak() -> int:
        if expandable_segments(device):
            read[0] = "allocated (expandable segments: the allocator's cache goes back where needed)"
            return allocated()
        read[0] = "held by the allocator"
        return held()

    return peak, lambda: read[0]


def cuda_reserved_peak(device: torch.device) -> Callable[[], int]:
    """The process's peak bytes the caching allocator held on ``device`` (``torch.cuda.max_memory_reserved``: what a
    memory-fraction cap limits, fragmentation included), as a callable."""
    return lambda: int(torch.cuda.max_memory_reserved(device))
