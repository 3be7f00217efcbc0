"""The optimizer object ``offload`` returns: a torch.optim.Optimizer whose step commits the offloaded update.

It is a real ``torch.optim.Optimizer`` (one parameter group holding every offloaded parameter), so learning
-rate schedulers work: the group's ``lr`` is read when a step's updates start. The update itself runs on the
CPU worker as gradients arrive; ``step()`` commits it and returns at once, and the next forward waits for
the blocks it needs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from runtime.controller import Controller


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW whose state lives in tierstore. Use like torch.optim.AdamW; see ``scale_loss`` for fp16."""

    def __init__(self, params: list[nn.Parameter], controller: Controller):
        hyper = controller.options.hyper
        defaults = dict(lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps, weight_decay=hyper.weight_decay)
        super().__init__(params, defaults)
        self.controller = controller
        controller.lr_source = lambda: float(self.param_groups[0]["lr"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Commit the update started by the last micro-batch's backward."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.controller.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop gradients held on the device (they are usually already offloaded and dropped)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """fp16: multiply the loss by the dynamic loss scale before backward (identity otherwise)."""
        return self.controller.scale_loss(loss)

    def synchronize(self) -> None:
        """Block until every committed update has finished (e.g. before reading weights)."""
        self.controller.synchronize()
