"""Dynamic fp16 loss scaling (``dtype: fp16``): the scale, its update rule and the step's overflow flag.

The gradients' part unscales each block's gradient into ``found_inf`` as it leaves the device
(``runtime.engine.gradients``); the commit reads the flag, skips an overflowing step and updates the scale
(``runtime.engine.commit``). What it leaves out: the loss itself (``optimizer.scale_loss``) and checkpointing the
scale (``runtime.checkpoint.state``).
"""

from __future__ import annotations

import torch


class LossScaler:
    """Dynamic fp16 loss scaling with torch's own update rule (the one GradScaler uses)."""

    def __init__(self, device: torch.device, initial: float, growth_factor: float, backoff_factor: float, growth_interval: int):
        self.scale = torch.full((), float(initial), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = int(growth_interval)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)  # the pending step overflowed

    def inv_scale(self) -> torch.Tensor:
        """1/scale computed as GradScaler computes it (in double, then float)."""
        return self.scale.double().reciprocal().float()

    def update(self) -> None:
        """Back off on overflow, grow after growth_interval clean steps; the next step starts with no overflow."""
        torch._amp_update_scale_(self.scale, self.growth_tracker, self.found_inf, self.growth_factor, self.backoff_factor,
                                 self.growth_interval)
        self.found_inf.zero_()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss times the current scale."""
        return loss * self.scale.to(loss.device)
