"""What to change when a training step runs out of GPU memory under ``auto`` placement.

``auto`` placement (``runtime.planning.auto_placement``) fills the GPU budget with optimizer state and kept weights up to a
reserve for activations, which it cannot know before the first step runs. When the step needs more, CUDA's
out-of-memory error names only the allocator's numbers; this module adds a log line, just before that error
reaches the user, that says what auto placement put on the GPU and which setting to change, with a figure:
``tiers.gpu.activation_reserve`` at least what the step tried to hold beside the store's memory.

What it leaves out: choosing anything (``runtime.planning.auto_placement``), catching or retrying the error (the user's
step is not ours to rerun). The observer hook is torch's (``torch._C._cuda_attach_out_of_memory_observer``,
the one memory snapshots use); torch keeps observers for the life of the process, so the one installed here
holds the session weakly and is silent once the session is closed.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

from runtime.config.units import SIZE_UNITS, approx_size

log = logging.getLogger(__name__)

GiB = SIZE_UNITS["GiB"]
Owner = TypeVar("Owner")
HEADROOM = 1.1  # the suggested reserve over what the failed step reached: the step may grow after the failure


def reserve_hint(*, requested_nbytes: int, allocated_nbytes: int, store_gpu_nbytes: int, reserve_nbytes: int,
                 placed_nbytes: int, recomputed: bool = False) -> str:
    """The log line for an out-of-memory error: the step held ``allocated_nbytes`` (``store_gpu_nbytes`` of them the
    store's) and asked for ``requested_nbytes`` more; ``auto`` placement had reserved ``reserve_nbytes`` for
    activations and put ``placed_nbytes`` of optimizer state and kept weights on the GPU. ``recomputed``: the
    layers' activations were being recomputed (a reserve set by hand turns off the measured steps that chose
    that, so the line names the setting too)."""
    needed = max(0, allocated_nbytes + requested_nbytes - store_gpu_nbytes)
    suggested = math.ceil(needed * HEADROOM / GiB)
    return (f"CUDA out of memory with auto placement: the step held {approx_size(allocated_nbytes)} "
            f"({approx_size(store_gpu_nbytes)} of it tierstore's) and asked for {approx_size(requested_nbytes)} more; "
            f"auto placement had reserved {approx_size(reserve_nbytes)} for activations and put "
            f"{approx_size(placed_nbytes)} of optimizer state and kept weights on the GPU. This step needs at least "
            f"{approx_size(needed)} beside tierstore's memory: set tiers.gpu.activation_reserve: {suggested}GiB "
            f"{'with placement.activations: recompute, as the layers were, ' if recomputed else ''}"
            f"(auto placement then puts less on the GPU), or lower tiers.gpu.budget / the batch size")


def install_oom_hint(owner: Owner, describe: Callable[[Owner, int, int], str | None]) -> bool:
    """Log ``describe(owner, requested_nbytes, allocated_nbytes)`` when CUDA runs out of memory while ``owner`` is
    alive (``describe`` returning None says nothing: e.g. the session is closed). ``describe`` gets the owner as an
    argument and must not hold it itself: torch keeps the observer for the life of the process, and a reference
    there would keep the owner (a whole session and its model) alive with it. False when this torch has no hook."""
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        return False
    alive = weakref.ref(owner)

    def observer(device: int, requested: int, allocated: int, free: int) -> None:
        owner = alive()
        if owner is None:
            return
        try:
            line = describe(owner, int(requested), int(allocated))
        except Exception:  # never turn the user's OOM into a different error
            log.exception("the out-of-memory hint failed")
            return
        if line:
            log.error("%s", line)

    attach(observer)
    return True
