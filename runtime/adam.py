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
        for source, target in zip(old, new):
            torch._foreach_copy_([target[i][a:b] for i, a, b in piece], [source[i][a:b] for i, a, b in piece])
        _fused_parts(piece, new, [grads[i][a:b] for i, a, b in piece], steps, hypers)


def _fused_parts(parts: list[tuple[int, int, int]], state: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
                 part_grads: list[torch.Tensor], steps: list[torch.Tensor], hypers: list[AdamWHyper]) -> None:
    """Fused AdamW in place on the (tensor position, start, end) ``parts`` of ``state`` (master, exp_avg, exp_avg_sq
    views), with ``part_grads`` parallel to ``parts``: one call per distinct hyper-parameter setting."""
    groups: dict[AdamWHyper, list[int]] = {}
    for number, part in enumerate(parts):
        groups.setdefault(hypers[part[0]], []).append(number)
    for hyper, numbers in groups.items():
        def pick(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            return [tensors[parts[n][0]][parts[n][1] : parts[n][2]] for n in numbers]

        torch._fused_adamw_(
            pick(state[0]), [part_grads[n] for n in numbers], pick(state[1]), pick(state[2]), [],
            [steps[parts[n][0]] for n in numbers],
            lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay, eps=hyper.eps,
            amsgrad=False, maximize=False,
        )


# Elements per piece of a scaled update (about 4 MiB of fp32 products): small enough to stay in the CPU's caches
# between the multiply that writes them and the kernel that reads them, large enough that each piece's calls
# cost little beside its work. A multiple of 64 elements, for the reason OUT_OF_PLACE_PIECE gives.
SCALED_PIECE = 1 << 20
_SCRATCH_ALIGN = 64  # elements: each part's products start on a cache line of the scratch buffer


class Scratch:
    """A reusable fp32 host buffer, grown on demand: fresh pages cost a page fault each on first touch, so the
    products of a scaled update go to memory that was touched before."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.float32)

    def get(self, numel: int) -> torch.Tensor:
        """A buffer of at least ``numel`` elements (its contents are undefined)."""
        if self._buffer.numel() < numel:
            self._buffer = torch.empty(numel, dtype=torch.float32)
        return self._buffer


def adamw_update_scaled(
    master: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avg: list[torch.Tensor],
    exp_avg_sq: list[torch.Tensor],
    steps: list[torch.Tensor],
    hypers: list[AdamWHyper],
    factors: list[list[torch.Tensor]],
    scratch: Scratch,
    piece_numel: int = SCALED_PIECE,
) -> None:
    """``adamw_update_grouped`` on each gradient multiplied by its ``factors`` (0-dim fp32, in the order given),
    without writing the products back: piece by piece the products land in ``scratch`` and the kernel reads them
    there while they are still in the CPU's caches. An in-place multiply first would be one more pass over the
    gradients in host memory (read and write), about a third of the kernel's own traffic. Bit-identical to
    multiplying in place, then ``adamw_update_grouped``: the same fp32 multiplies element by element, and pieces
    that begin at multiples of ``piece_numel`` in each tensor (see OUT_OF_PLACE_PIECE). The gradients are left as
    they were. Increments steps."""
    if not any(factors):
        adamw_update_grouped(master, grads, exp_avg, exp_avg_sq, steps, hypers)
        return
    torch._foreach_add_(steps, 1)
    for piece in _pieces([g.numel() for g in grads], piece_numel):
        room = scratch.get(sum(-(-(b - a) // _SCRATCH_ALIGN) * _SCRATCH_ALIGN for _, a, b in piece))
        part_grads, offset = [], 0
        for i, a, b in piece:
            product = grads[i][a:b]
            for factor in factors[i]:
                out = room[offset : offset + b - a]
                torch.mul(product, factor, out=out)
                product = out
            offset += -(-(b - a) // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
            part_grads.append(product)
        _fused_parts(piece, (master, exp_avg, exp_avg_sq), part_grads, steps, hypers)


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
