"""Gradients of host-updated blocks held on the device until the step commits.

[Note: held gradients] When updates wait for the commit (clipping, fp16 loss scaling, the user's own
clipping), a host-updated block's gradient used to leave the device as soon as its backward finished, and at
the commit the CPU multiplied it by the clip coefficient: one more pass over host memory per parameter, on the
critical path (the CPU's AdamW is memory-bound, and the pass cost about a third of the kernel's time). Held
here instead, the gradient is scaled on the device at the commit (the same fp32 multiply, so the same bits)
and only then copied to host, in forward order and ahead of the streamed state's write-backs, so the CPU
starts the first block's update a few milliseconds after the commit and skips the pass.

Holding must not raise the step's memory: a gradient is held only while the memory allocated on the device,
plus the state of streamed blocks still to come in (which shares the room the backward frees), stays within
what was allocated when the backward began; otherwise it leaves at once as before, and the worker scales it.
A step whose host updates run before the commit (``runtime.speculation``) holds nothing: those need the
gradient on host during the backward. Without CUDA (the CPU tests) the room is not limited.

What it leaves out: when the commit happens and what runs after it (``runtime.controller``).
"""

from __future__ import annotations

import torch


class HeldGrads:
    """Device gradients (fp32, flat, one per block) of the pending step, by block index."""

    def __init__(self, device: torch.device):
        self.device = device
        self._held: dict[int, torch.Tensor] = {}
        self._ceiling: int | None = None  # device bytes allocated when the step's last backward began

    def begin(self) -> None:
        """The backward that ends the step starts: its memory in use now bounds what may be held."""
        self._ceiling = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None

    def try_hold(self, index: int, flat: torch.Tensor, still_to_come_nbytes: int = 0) -> bool:
        """Keep block index's gradient ``flat`` (already allocated) on the device if that stays within the
        room (see the note); ``still_to_come_nbytes``: device bytes other copies will need before the commit."""
        if self.device.type == "cuda":
            if self._ceiling is None or torch.cuda.memory_allocated(self.device) + still_to_come_nbytes > self._ceiling:
                return False
        self._held[index] = flat
        return True

    def holds(self, index: int) -> bool:
        """True while block index's gradient of the pending step is held."""
        return index in self._held

    def take(self) -> dict[int, torch.Tensor]:
        """Every held gradient in forward order; none are held afterwards."""
        held, self._held = self._held, {}
        return dict(sorted(held.items()))

    def drop(self) -> None:
        """A dropped step: its held gradients go."""
        self._held = {}
        self._ceiling = None

    @property
    def nbytes(self) -> int:
        """Device bytes held now."""
        return sum(flat.numel() * flat.element_size() for flat in self._held.values())
