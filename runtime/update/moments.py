"""STAND-IN for h-moments' ``runtime/update/moments.py`` (issue 43): the interface of the brief with the simplest
bodies, so the plumbing is written and tested before theirs lands. Their file replaces this one at the merge.

int8 layout here (the brief's): each parameter's codes padded to whole ``QUANT_BLOCK`` blocks, then one fp32 scale
a block, the buffer a multiple of 64 bytes. exp_avg: signed absmax codes around 128; exp_avg_sq: sqrt map.
"""

from __future__ import annotations

import torch

from runtime.planning.moment_sizes import MOMENT_DTYPES, QUANT_BLOCK, stored_moment_nbytes
from runtime.update.adam import AdamWHyper, adamw_update_grouped, adamw_update_out_of_place, split_views

__all__ = ["MOMENT_DTYPES", "QUANT_BLOCK", "adamw_update_block", "decode_moment", "encode_moment", "moment_nbytes",
           "moment_storage", "zero_moments"]


def moment_storage(moment_dtype: str, sizes: list[int]) -> tuple[torch.dtype, int]:
    """The dtype and numel of the one flat stored buffer of one moment of a block of parameters of ``sizes``."""
    nbytes = stored_moment_nbytes(moment_dtype, sizes)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[moment_dtype]
    return dtype, nbytes // dtype.itemsize


def moment_nbytes(moment_dtype: str, sizes: list[int]) -> int:
    """Bytes of one moment's stored buffer."""
    return stored_moment_nbytes(moment_dtype, sizes)


def _blocks(sizes: list[int]) -> list[tuple[int, int, int]]:
    """(value start, value end, code start) of each int8 block, in order."""
    out, value, code = [], 0, 0
    for size in sizes:
        for start in range(0, size, QUANT_BLOCK):
            end = min(size, start + QUANT_BLOCK)
            out.append((value + start, value + end, code + start))
        value += size
        code += -(-size // QUANT_BLOCK) * QUANT_BLOCK
    return out


def _scales(stored: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    blocks = len(_blocks(sizes))
    codes = blocks * QUANT_BLOCK
    return stored[codes : codes + 4 * blocks].view(torch.float32)


def zero_moments(stored: torch.Tensor, moment_dtype: str, sizes: list[int]) -> None:
    """Fill a stored buffer with the encoding of zeros."""
    stored.zero_()  # int8 here: code 0 and scale 0 are zeros too


def decode_moment(stored: torch.Tensor, moment_dtype: str, kind: str, sizes: list[int]) -> torch.Tensor:
    """The fp32 values of a stored moment (a new flat tensor)."""
    if moment_dtype != "int8":
        return stored.to(torch.float32, copy=True)
    scales = _scales(stored, sizes)
    out = torch.empty(sum(sizes), dtype=torch.float32)
    for number, (start, end, code) in enumerate(_blocks(sizes)):
        q = stored[code : code + end - start].view(torch.int8).to(torch.float32)
        out[start:end] = q / 127 * scales[number] if kind == "exp_avg" else (q / 127) ** 2 * scales[number]
    return out


def encode_moment(values: torch.Tensor, moment_dtype: str, kind: str, sizes: list[int], out_stored: torch.Tensor) -> None:
    """Write fp32 ``values`` into a stored buffer."""
    if moment_dtype != "int8":
        out_stored.copy_(values)
        return
    scales = _scales(out_stored, sizes)
    for number, (start, end, code) in enumerate(_blocks(sizes)):
        v = values[start:end]
        if kind == "exp_avg":
            scale = float(v.abs().max()) if v.numel() else 0.0
            q = (v / scale * 127).round() if scale > 0 else torch.zeros_like(v)
        else:
            scale = float(v.max()) if v.numel() else 0.0
            q = ((v / scale).clamp_min(0).sqrt() * 127).ceil() if scale > 0 else torch.zeros_like(v)
        out_stored[code : code + end - start].view(torch.int8).copy_(q.clamp(-127, 127).to(torch.int8))
        scales[number] = scale


def adamw_update_block(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       sizes: list[int], keep: list[bool], steps: list[torch.Tensor], hypers: list[AdamWHyper],
                       moment_dtype: str, *, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """One AdamW step over a block; ``steps`` and ``hypers`` are the kept parameters'; ``out``: out of place."""
    def views(flat: torch.Tensor) -> list[torch.Tensor]:
        return [v for v, k in zip(split_views(flat, sizes), keep, strict=True) if k]

    if moment_dtype == "fp32":
        if out is None:
            adamw_update_grouped(views(master), views(grad), views(exp_avg), views(exp_avg_sq), steps, hypers)
            return
        adamw_update_out_of_place((views(master), views(exp_avg), views(exp_avg_sq)),
                                  (views(out[0]), views(out[1]), views(out[2])), views(grad), steps, hypers)
        for source, target in zip((master, exp_avg, exp_avg_sq), out, strict=True):
            for s, t, k in zip(split_views(source, sizes), split_views(target, sizes), keep, strict=True):
                if not k:
                    t.copy_(s)
        return
    m = decode_moment(exp_avg, moment_dtype, "exp_avg", sizes)
    v = decode_moment(exp_avg_sq, moment_dtype, "exp_avg_sq", sizes)
    target = master
    if out is not None:
        out[0].copy_(master)
        target = out[0]
    adamw_update_grouped(views(target), views(grad), views(m), views(v), steps, hypers)
    encode_moment(m, moment_dtype, "exp_avg", sizes, exp_avg if out is None else out[1])
    encode_moment(v, moment_dtype, "exp_avg_sq", sizes, exp_avg_sq if out is None else out[2])
