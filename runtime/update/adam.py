"""AdamW over a block's flat fp32 buffers, with torch's fused kernel (CPU or CUDA).

The kernel is called on per-parameter views of the flat buffers, with one step counter per parameter:
exactly the tensor list ``torch.optim.AdamW(fused=True)`` sees, so results are bit-identical to it in fp32
(and a parameter that got no gradient keeps its own step count, as in the reference).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from runtime.core.blocks import Block


@dataclass(frozen=True)
class AdamWHyper:
    """AdamW hyper-parameters (torch.optim.AdamW's meaning)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


# The order of the constants in :func:`bf16_update_constants` (and of a row of the compiled kernel's table).
BF16_CONSTANTS = ("decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "step_size", "inv_bias_root", "eps")


def bf16_update_constants(hyper: AdamWHyper, step: float) -> tuple[float, ...]:
    """The constants of bf16 moments' AdamW step (:data:`BF16_CONSTANTS`) for a parameter whose step counter reads
    ``step`` after its increment, in Python floats (double): each is rounded to fp32 once, where it is used, as
    torch rounds a Python scalar it multiplies an fp32 tensor by (``runtime.update.moments`` says the sequence of
    operations they enter). Computed here once for every implementation: the torch-ops path takes them as scalars,
    the compiled kernel as a float32 table, so both round the same doubles. The step-dependent two are
    :func:`bf16_step_constants`'s."""
    step_size, inv_bias_root = bf16_step_constants(hyper, step)
    return (1.0 - hyper.lr * hyper.weight_decay, hyper.beta1, 1.0 - hyper.beta1, hyper.beta2, 1.0 - hyper.beta2,
            step_size, inv_bias_root, hyper.eps)


StepT = TypeVar("StepT", float, torch.Tensor)


def bf16_step_constants(hyper: AdamWHyper, step: StepT) -> tuple[StepT, StepT]:
    """(step_size, inv_bias_root) of :data:`BF16_CONSTANTS` at ``step`` (after its increment): one formula, the same
    operations in the same order, for a Python float (the CPU's constants, in doubles) and for a float64 tensor of
    step counters (CUDA's, computed on the device without reading the counters)::

        step_size = lr / (1 - beta1 ** step)          one correctly rounded division
        inv_bias_root = 1 / sqrt(1 - beta2 ** step)

    With tensors the division is ``torch.div`` of two tensors (``lr / tensor`` would be ``reciprocal() * lr`` in
    torch: two roundings). Where the two still differ: a device's ``pow`` (and the CPU's float64 ``torch.sqrt``) need
    not round as the C library's ``pow`` and ``math.sqrt`` do, a double's last bit, which moves the fp32 constant
    only where it lies that close to an fp32 rounding boundary."""
    pow_: Any
    div: Any
    sqrt: Any
    if isinstance(step, torch.Tensor):
        pow_, div, sqrt = torch.pow, _tensor_div, torch.sqrt
    else:
        pow_, div, sqrt = operator.pow, operator.truediv, math.sqrt
    step_size = div(hyper.lr, 1.0 - pow_(hyper.beta1, step))
    inv_bias_root = div(1.0, sqrt(1.0 - pow_(hyper.beta2, step)))
    return step_size, inv_bias_root


def _tensor_div(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` as one division an element (torch.div of two tensors; no sync on a device)."""
    return torch.div(torch.full_like(denominator, numerator), denominator)


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
        group_master, group_grads, group_exp_avg, group_exp_avg_sq, group_steps = (
            [tensors[p] for p in positions] for tensors in (master, grads, exp_avg, exp_avg_sq, steps))
        adamw_update(group_master, group_grads, group_exp_avg, group_exp_avg_sq, group_steps, hyper)


# Elements per piece of an out-of-place update: a piece's state is copied, then updated while it is still in the
# CPU's caches, so the copy costs one more read than an in-place update instead of a second pass. A multiple of
# 64 elements: the fused kernel splits work at cache-line multiples and vectorizes from each piece's start, so
# pieces that begin at such offsets compute every element exactly as one call over the whole tensor does.
OUT_OF_PLACE_PIECE = 1 << 20


def adamw_update_out_of_place(
    old: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
    new: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
    grads: list[torch.Tensor],
    steps: list[torch.Tensor],
    hypers: list[AdamWHyper],
    piece_numel: int = OUT_OF_PLACE_PIECE,
) -> None:
    """``adamw_update_grouped`` whose result lands in ``new`` (master, exp_avg, exp_avg_sq views, parallel to
    ``old``'s) while ``old`` keeps the values it had: the state before the step survives until the result is
    published. Bit-identical to the in-place update. Increments steps."""
    if not grads:
        return
    torch._foreach_add_(steps, 1)
    for piece in _pieces([g.numel() for g in grads], piece_numel):
        for source, target in zip(old, new, strict=True):
            torch._foreach_copy_([target[i][a:b] for i, a, b in piece], [source[i][a:b] for i, a, b in piece])
        groups: dict[AdamWHyper, list[tuple[int, int, int]]] = {}
        for part in piece:
            groups.setdefault(hypers[part[0]], []).append(part)
        for hyper, parts in groups.items():
            master, grad, exp_avg, exp_avg_sq = (
                [tensors[i][a:b] for i, a, b in parts] for tensors in (new[0], grads, new[1], new[2]))
            torch._fused_adamw_(
                master, grad, exp_avg, exp_avg_sq, [], [steps[i] for i, _, _ in parts],
                lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay, eps=hyper.eps,
                amsgrad=False, maximize=False,
            )


def _pieces(sizes: list[int], piece_numel: int) -> list[list[tuple[int, int, int]]]:
    """(tensor position, start, end) ranges covering every tensor, gathered into pieces of about piece_numel
    elements; a tensor is split only at multiples of piece_numel from its own start."""
    pieces: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    filled = 0
    for position, size in enumerate(sizes):
        for start in range(0, size, piece_numel):
            end = min(size, start + piece_numel)
            current.append((position, start, end))
            filled += end - start
            if filled >= piece_numel:
                pieces.append(current)
                current, filled = [], 0
    if current:
        pieces.append(current)
    return pieces


def scale_slots(flat: torch.Tensor, block: Block, scales: list[torch.Tensor | None] | None,
                 multiplier: torch.Tensor | None) -> None:
    """Multiply a block's flat gradient by the user's per-parameter factors, then by tierstore's clip
    coefficient, in the order the plain loop applies them."""
    if scales is not None:
        for slot, scale in zip(block.slots, scales, strict=True):  # one factor (or None) per slot
            if scale is not None:
                flat[slot.offset : slot.offset + slot.numel].mul_(scale.to(flat.device))
    if multiplier is not None:
        flat.mul_(multiplier.to(flat.device))
