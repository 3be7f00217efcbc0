"""bf16 moments' AdamW arithmetic in torch ops (``runtime.update.moments`` defines the sequence; the compiled
kernel's ``adamw_bf16`` is held to it bit for bit, and checks itself against it when built:
``runtime.update.moment_kernel``).

Owns: the op sequence over fp32 tensors (:func:`bf16_ops_step`) and its correctly rounded root
(:func:`sqrt_rounded_into`). Leaves out: pieces, widening and narrowing (``moments``), the constants
(``adam.bf16_update_constants``).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["NUMPY_ROOT_THREADS", "Bf16Constant", "bf16_ops_step", "sqrt_rounded_into"]

# One bf16 constant: a Python float (torch rounds it to fp32 where it multiplies or adds), or, on CUDA, a 0-dim fp32
# tensor of the device (the step-dependent ones, computed there from the step counters: no sync).
Bf16Constant = float | torch.Tensor


def bf16_ops_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                  constants: tuple[Bf16Constant, ...], t: torch.Tensor, d: torch.Tensor,
                  work: torch.Tensor | None = None) -> None:
    """One bf16 AdamW step in place on fp32 ``p``, ``m``, ``v`` (1-D, contiguous, as long as ``g``) with
    ``constants`` (``adam.BF16_CONSTANTS``' order): each torch op below one IEEE operation an element (no lerp,
    addcmul, addcdiv or alpha). ``t``, ``d``: fp32 temporaries of the same length; ``work``: the root's
    (:func:`sqrt_rounded_into`), overlapping neither ``d`` nor ``v`` (``t`` may lie inside it: free by then)."""
    decay, b1, c1, b2, c2, step_size, inv_bias_root, eps = constants
    p.mul_(decay)                     # p = p * decay
    m.mul_(b1)                        # m = (m * b1) + (g * c1)
    torch.mul(g, c1, out=t)
    m.add_(t)
    v.mul_(b2)                        # v = (v * b2) + ((g * g) * c2)
    torch.mul(g, g, out=t)
    t.mul_(c2)
    v.add_(t)
    sqrt_rounded_into(v, d, work)     # d = (sqrt(v) * inv_bias_root) + eps
    d.mul_(inv_bias_root)
    d.add_(eps)
    torch.div(m, d, out=d)            # p = p - ((m / d) * step_size)
    d.mul_(step_size)
    p.sub_(d)


# Below this many torch threads the CPU's root is numpy's (one thread): on one EPYC core (2026-11-29) numpy's fp32
# root took 0.29 ns an element, torch's float64 root with its conversions 1.74 ns a thread.
NUMPY_ROOT_THREADS = 6


def sqrt_rounded_into(values: torch.Tensor, out: torch.Tensor, work: torch.Tensor | None = None) -> None:
    """The correctly rounded fp32 square root of contiguous fp32 ``values`` (IEEE's, what the compiled kernel's
    vsqrtps gives) into fp32 ``out``: torch.sqrt on the CPU is not (torch 2.13, AVX-512: 1 ulp off for about a fifth
    of the values). On the CPU with fewer than :data:`NUMPY_ROOT_THREADS` threads numpy's fp32 root (the hardware's,
    IEEE's); else taken in float64 and narrowed once: a double root within one of its ulps (2^-52 relative) of the
    exact one rounds to the fp32 nearest the exact root, whose distance from an fp32 rounding boundary is at least
    2^-51 relative (a 24-bit value is never within that of a square of a 25-bit one). Both give the same bits
    (test_moments_update checks them against each other). ``work``: a contiguous fp32 buffer of the values' device,
    overlapping neither, whose bytes hold the float64 values (half its length at a time): the update passes its free
    temporary, so the root allocates nothing the memory plan does not count; None (or under two values): one float64
    copy is allocated."""
    if out.dtype != torch.float32 or values.dtype != torch.float32:
        raise TypeError(f"sqrt_rounded_into: fp32 values and out, got {values.dtype} and {out.dtype}")
    if values.device.type == "cpu" and torch.get_num_threads() < NUMPY_ROOT_THREADS:
        np.sqrt(values.numpy(), out=out.numpy())
        return
    if work is None or work.numel() < 2:  # (a scratch of one value: its copy costs nothing)
        out.copy_(values.to(torch.float64).sqrt_())
        return
    doubles = work[: work.numel() // 2 * 2].view(torch.float64)
    for start in range(0, values.numel(), doubles.numel()):
        end = min(values.numel(), start + doubles.numel())
        wide = doubles[: end - start]
        wide.copy_(values[start:end])
        out[start:end].copy_(wide.sqrt_())
