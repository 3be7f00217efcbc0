"""The reference of bf16 moments' AdamW arithmetic, written here with plain torch ops, apart from the runtime's two
implementations (the torch-ops path of ``runtime.update.moments`` and the compiled kernel's ``adamw_bf16``), which
the tests hold to it bit for bit. Per element, in fp32, each operation rounded on its own (t: the parameter's step
after its increment; the constants computed in Python doubles and rounded to fp32 by torch where they multiply or
add)::

    p = p * (1 - lr * wd)
    m = (m * beta1) + (g * (1 - beta1))
    v = (v * beta2) + ((g * g) * (1 - beta2))
    d = (sqrt(v) * (1 / sqrt(1 - beta2 ** t))) + eps
    p = p - ((m / d) * (lr / (1 - beta1 ** t)))

The narrowing to bf16 after the step is the update's (``narrow_bf16`` of the unit tests, the integration tests'
hook). :class:`PlainAdamW` is the same step as a ``torch.optim.Optimizer`` for the plain training loops.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def sqrt_rounded(values: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (IEEE's): torch.sqrt of fp32 on the CPU is not (one ulp off for some
    values), the float64 root narrowed once is (test_moments_update checks it against numpy's)."""
    return torch.sqrt(values.double()).float()


def plain_adamw_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: float, lr: float,
                     beta1: float, beta2: float, eps: float, weight_decay: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """New fp32 (p, m, v) of one step (the module's sequence; ``step`` incremented already), out of place."""
    step_size = lr / (1 - beta1 ** step)
    inv_bias_root = 1 / math.sqrt(1 - beta2 ** step)
    p = p * (1 - lr * weight_decay)
    m = (m * beta1) + (g * (1 - beta1))
    v = (v * beta2) + ((g * g) * (1 - beta2))
    d = (sqrt_rounded(v) * inv_bias_root) + eps
    p = p - ((m / d) * step_size)
    return p, m, v


class PlainAdamW(torch.optim.Optimizer):
    """AdamW whose step is :func:`plain_adamw_step` on fp32 state (``exp_avg``, ``exp_avg_sq``, a float32 ``step``
    tensor, as torch.optim.AdamW keeps them), with torch.optim.AdamW's defaults and parameter groups; a parameter
    without a gradient is skipped, its step too."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                p, m, v = plain_adamw_step(param, param.grad, state["exp_avg"], state["exp_avg_sq"],
                                           float(state["step"]), group["lr"], beta1, beta2, group["eps"],
                                           group["weight_decay"])
                param.copy_(p)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
        return None
