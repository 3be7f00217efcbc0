"""Sizes of the fixed buffers the engine allocates, which the memory plan counts before anything exists.

The engine's modules import these from here, so that the plan and the allocation can never disagree and the plan
needs nothing above it.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


STAGING_SLOTS = 4  # pinned buffers the gradients leave the device through, a piece at a time

PIECE_NUMEL = 1 << 26  # elements per piece: a buffer holds 256 MiB of fp32, whatever the block's size


FETCH_PIECE_NUMEL = 1 << 26  # fp32 elements a piece of a master fetch is staged in: 256 MiB ([Note: fetch staging])

# Elements of a piece of a device update over compact moments (optimizer.moment_dtype bf16, int8): the update decodes
# a piece into an fp32 scratch of two moments and two temporaries, 16 bytes an element (64 MiB), updates and encodes
# it back; large enough that a piece's dozen kernels cost little beside its data. A multiple of the int8 block.
# bf16's float64 root takes no more: its values live in a temporary free at that point (moments.sqrt_rounded_into).
DEVICE_MOMENT_PIECE_NUMEL = 1 << 22
MOMENT_SCRATCH_ITEMSIZE = 16


def allocator_limit_nbytes(device: torch.device) -> int | None:
    """What the CUDA caching allocator may hold on ``device`` (the card's memory times the process's memory
    fraction); None off CUDA."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
    if get_fraction is None:
        log.warning("this torch cannot report the process's GPU memory fraction: a capped forward is paced as if "
                    "it had the whole card")
    fraction = get_fraction(device) if get_fraction is not None else 1.0
    return int(total * min(1.0, fraction))
