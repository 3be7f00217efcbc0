"""AdamW over a block's flat fp32 buffers, with torch's fused kernel (CPU or CUDA).

The kernel is called on per-parameter views of the flat buffers, with one step counter per parameter:
exactly the tensor list ``torch.optim.AdamW(fused=True)`` sees, so results are bit-identical to it in fp32
(and a parameter that got no gradient keeps its own step count, as in the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamWHyper:
    """AdamW hyper-parameters (torch.optim.AdamW's meaning)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


def split_views(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Consecutive 1-D views of flat with the given element counts."""
    views, offset = [], 0
    for size in sizes:
        views.append(flat[offset : offset + size])
        offset += size
    return views


def adamw_update(
    master: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avg: list[torch.Tensor],
    exp_avg_sq: list[torch.Tensor],
    steps: list[torch.Tensor],
    hyper: AdamWHyper,
    lr: float | None = None,
) -> None:
    """One AdamW step in place on parallel lists of views (all fp32, same device). Increments steps."""
    if not master:
        return
    torch._foreach_add_(steps, 1)  # the reference increments before the update; one call, not one per tensor
    torch._fused_adamw_(
        master,
        grads,
        exp_avg,
        exp_avg_sq,
        [],
        steps,
        lr=hyper.lr if lr is None else lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
    )


def adamw_update_grouped(
    master: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avg: list[torch.Tensor],
    exp_avg_sq: list[torch.Tensor],
    steps: list[torch.Tensor],
    hypers: list[AdamWHyper],
) -> None:
    """``adamw_update`` where each tensor has its own hyper-parameters (its parameter group's): one fused call
    per distinct setting, as torch.optim.AdamW makes one per group. The update is elementwise, so grouping
    does not change a bit of the result."""
    groups: dict[AdamWHyper, list[int]] = {}
    for position, hyper in enumerate(hypers):
        groups.setdefault(hyper, []).append(position)
    for hyper, positions in groups.items():
        def pick(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            return [tensors[p] for p in positions]

        adamw_update(pick(master), pick(grads), pick(exp_avg), pick(exp_avg_sq), pick(steps), hyper)
