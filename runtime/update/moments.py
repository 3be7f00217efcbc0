"""AdamW over a block whose moments are stored in any ``optimizer.moment_dtype`` (fp32, bf16, int8).

Owns: one AdamW step over a block's flat buffers (:func:`adamw_update_block`), in place or out of place, for every
moment format, and the public names of the formats (``runtime.update.moment_formats`` holds the layouts and maps).
Leaves out: fp32's and int8's AdamW itself (``runtime.update.adam``: torch's fused AdamW, whose fp32 result is
the reference), where the buffers live and when an update runs (the worker and the engine).

fp32 calls ``adam.adamw_update_grouped`` (or ``adamw_update_out_of_place``) on per-parameter views: bit-identical
to today. bf16 and int8 work piece by piece: a piece's moments are decoded into an fp32 scratch, AdamW runs on the
piece's per-parameter sub-views of master, gradient and scratch (int8: torch's fused AdamW; bf16: the sequence
below), and the scratch is encoded back.
The scratch holds one piece, so the decode, the update and the encode touch data still in the CPU's caches, and
main memory sees only the stored bytes, each read and written once: master 4 + 4, gradient 4, each moment twice its
stored size (28 bytes a parameter with fp32 moments, 20 with bf16, 16 with int8). A piece is
:data:`PIECE_NUMEL_PER_THREAD` elements for each of torch's threads: each elementwise op splits its range statically
between the threads, so a thread meets the same slice of the piece in every op; and a piece is large enough that its
torch calls (about fifteen a parameter for bf16, about thirty for int8) cost little beside its data.

bf16's AdamW is its own: a fixed sequence of single fp32 operations, each rounded on its own (multiply, add,
subtract, divide, square root; no lerp, addcmul, addcdiv, fused multiply-add or alpha), one division and one root
an element, so that any implementation of it gets the same bits: the torch ops here (CPU and CUDA), the compiled
kernel (``moment_kernel_source``'s ``adamw_bf16``, built without contraction) and the tests' plain-ops reference
(tests/bf16_reference.py). With the constants of ``adam.bf16_update_constants`` (Python doubles, each rounded to
fp32 once where it is used, as torch rounds a Python scalar; t the parameter's step after its increment)::

    p = p * decay                               decay = 1 - lr * weight_decay
    m = (m * beta1) + (g * (1 - beta1))
    v = (v * beta2) + ((g * g) * (1 - beta2))
    d = (sqrt(v) * inv_bias_root) + eps         inv_bias_root = 1 / sqrt(1 - beta2 ** t)
    p = p - ((m / d) * step_size)               step_size = lr / (1 - beta1 ** t)

sqrt is IEEE's (correctly rounded); torch.sqrt of fp32 on the CPU is not (1 ulp off for about a fifth of the values,
torch 2.13 with AVX-512), so the torch-ops path takes numpy's on a CPU with few threads, else the float64 root
narrowed once (``bf16_arith.sqrt_rounded_into``, its float64 values in the piece's free temporary: both exact). Why not
torch's fused AdamW on the widened moments, as bf16 did first: its bits are its build's (its vector width, its
compiler's contractions), which a compiled kernel cannot reproduce, so the kernel had to call it on each chunk and
could not be faster than fp32's update on one core (the kernel's docstring has the measurements). After one step
the result is within a few fp32 ulps of torch.optim.AdamW's before the narrowing; over steps a moment sometimes
narrows one bf16 step apart, and masters drift by a few thousandths of lr at most
(tests/unit/runtime/update/test_moments_update.py: 1.2e-5 lr measured over five steps).

Speed (torch ops): bf16 adds four conversion passes over cached data (and since its own arithmetic, above, about
fifteen calls a run of parameters and the root's conversions: numpy's fp32 root below NUMPY_ROOT_THREADS threads, the
float64 one, three passes more, from there), int8 about twenty-five elementwise passes (the maps, two
amax) and three rsqrt an element: where the fp32 update is bound by memory bandwidth (many cores sharing it) they
cost less than the bytes they save; where one core streams memory as fast as it computes they do not. On one EPYC
core streaming 58 GB/s (2026-11-29, 64 Mi parameters, ``python -m runtime.bench.adam_bench --threads 1``): fp32
2.15 G parameters/s, bf16 0.56x of it (0.40x with its v's stochastic rounding, three int32 passes more a piece:
one core of the 2-core box, 7.1 M parameters), int8 0.17x. Each torch op is one parallel region, so int8's thirty a piece
also wait thirty times for the slowest thread: on cores shared with other busy processes that cost far more than
the work (2 threads of 2 busy cores: int8 0.04x). Hence the opt-in compiled kernel (``runtime.update.moment_kernel``, a
:class:`MomentScratch` holding an :class:`Int8Kernel`, which serves bf16 too): one parallel region for the whole
update, each block decoded, updated and encoded while in cache (bf16: the sequence above in registers, the same
bits as here). CPU time of one update of 16 Mi parameters on one EPYC core (2026-11-29): fp32 7.7 ms, int8 kernel
12.8 ms, bf16 kernel 14.7 ms when it ran torch's fused AdamW on widened chunks, bf16 in torch ops 20.3 ms then; with
bf16's own arithmetic (one busy core of the 2-core box, ``adam_bench --threads 1 --numel 16000000``) the kernel went
from 0.57x fp32's parameters a second to 0.97-1.03x over several runs (0.99x in the bench's table; without its
root and division it ran no faster there: both updates wait on the same streams), and the torch ops (fifteen calls
a parameter, numpy's root) from 0.38x to 0.21x (0.13x with the float64 root): the kernel is what runs wherever a
compiler is. On the H200 machine's 16 Xeon cores (2026-11-29): int8 kernel 1.17x fp32 (one
root and one division an element: ``moment_kernel_source``), bf16 kernel 0.68x with torch's fused AdamW (not
measured there since).
(torch.compile was tried first: 2.3x faster maps alone, the whole piece slower than eager, on this CPU.)

Pieces split a parameter only at multiples of the piece size from its start (a multiple of the int8 block, so
blocks never span pieces, and of 64 elements, so the fused kernel computes every element as one call over the
whole tensor does). bf16's arithmetic is elementwise, so its result is bit-identical to widening, the sequence over
whole fp32 tensors, and narrowing, parameter by parameter, as ``moment_formats`` defines it (its stochastic rounding
takes each element's bits from its index in the block and its parameter's step, never from the piece). A piece
holds consecutive kept parameters only, so its stored range is contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from runtime.update.adam import (
    AdamWHyper,
    adamw_update_grouped,
    adamw_update_out_of_place,
    bf16_step_constants,
    bf16_update_constants,
    split_views,
)
from runtime.update.bf16_arith import NUMPY_ROOT_THREADS, Bf16Constant, bf16_ops_step, sqrt_rounded_into
from runtime.update.moment_formats import (
    MOMENT_DTYPES,
    QUANT_BLOCK,
    DecodeScratch,
    check_stored,
    decode_into,
    decode_moment,
    encode_from,
    encode_moment,
    int8_tail,
    int8_views,
    moment_nbytes,
    moment_storage,
    padded_numel,
    round_bf16_stochastic,
    rounding_bits,
    rounding_offsets,
    zero_moments,
)
from runtime.update.moment_kernel import Int8Kernel

__all__ = [
    "MOMENT_DTYPES",
    "QUANT_BLOCK",
    "PIECE_NUMEL_PER_THREAD",
    "Int8Kernel",
    "MomentScratch",
    "adamw_update_block",
    "kept_entries",
    "decode_moment",
    "default_piece_numel",
    "encode_moment",
    "moment_nbytes",
    "moment_storage",
    "scratch_nbytes",
    "sqrt_rounded_into",
    "NUMPY_ROOT_THREADS",
    "zero_moments",
]

# Elements of a piece per thread, a multiple of QUANT_BLOCK. Its fp32 moments and two temporaries (16 bytes an element,
# 4 MiB) stay in the L2 and L3 caches; smaller pieces would fit a 1-2 MiB L2 but each piece costs about 40 us of
# Python and torch calls (fused AdamW's alone 17 us): on one EPYC core, pieces of 64 Ki elements took 1.7x (bf16)
# and 1.3x (int8) the time of 256 Ki; 1 Mi made bf16 7% faster and int8 6% slower. `adam_bench --piece-numel` sweeps it.
PIECE_NUMEL_PER_THREAD = 1 << 18

# The bf16 moments narrowed by stochastic rounding in the update ([Note: bf16 stochastic rounding] in moment_formats);
# the others round to nearest even. exp_avg_sq only: v's 0.1% decay a step is what nearest rounding loses, while m
# moves 10% a step toward the gradient, above a bf16 step; on the tiny LM rounding m stochastically too changed the
# held-out loss by no more than the rounding seed does, and it doubles the rounding's cost (see the user guide).
BF16_STOCHASTIC_KINDS: tuple[str, ...] = ("exp_avg_sq",)


T = TypeVar("T")


def kept_entries(values: Sequence[T], keep: Sequence[bool]) -> list[T]:
    """The entries of the parameters that got a gradient (``keep``): what ``adamw_update_block`` takes of the
    per-parameter step counters and hyper-parameters."""
    return [value for value, k in zip(values, keep, strict=False) if k]


def default_piece_numel() -> int:
    """Elements of a piece at torch's current thread count."""
    return PIECE_NUMEL_PER_THREAD * max(1, torch.get_num_threads())


def scratch_nbytes(threads: int | None = None) -> int:
    """Bytes of one :class:`MomentScratch` at its largest (four fp32 buffers of a piece), for a host budget to count:
    4 MiB a thread at the default piece size. bf16's float64 root adds none: it holds its values in a temporary
    that is free at that point (:func:`sqrt_rounded_into`)."""
    return 4 * 4 * PIECE_NUMEL_PER_THREAD * max(1, torch.get_num_threads() if threads is None else threads)


class MomentScratch:
    """fp32 scratch for one piece's decoded moments and the maps' temporaries; reused across calls by whoever keeps
    it (one per thread that updates: the buffers are written by each call). Grows to the largest piece asked.
    ``int8_kernel`` (:meth:`Int8Kernel.build`, the compiled kernel of int8 and bf16 moments; the engine's name for
    it): int8 and bf16 updates of CPU tensors run it instead of torch ops."""

    def __init__(self, device: torch.device | str = "cpu", int8_kernel: Int8Kernel | None = None):
        self.device = torch.device(device)
        self.int8_kernel = int8_kernel  # opt-in: int8 and bf16 updates of CPU tensors run the compiled kernel
        self.numel = 0
        self._buffers: tuple[torch.Tensor, torch.Tensor, DecodeScratch] | None = None

    def take(self, numel: int) -> tuple[torch.Tensor, torch.Tensor, DecodeScratch]:
        """(exp_avg, exp_avg_sq, temporaries), each of at least ``numel`` elements."""
        if self._buffers is None or self.numel < numel:
            self._buffers = None  # the old ones go before the larger ones are taken
            self._buffers = (torch.empty(numel, dtype=torch.float32, device=self.device),
                             torch.empty(numel, dtype=torch.float32, device=self.device),
                             DecodeScratch(numel, self.device))
            self.numel = numel
        return self._buffers


@dataclass(frozen=True)
class _Part:
    """A parameter's elements [start, end) within a piece."""

    kept: int  # position among the kept parameters (steps, hypers)
    start: int
    end: int
    flat: int  # offset of start in the flat fp32 buffers
    local: int  # offset of start in the piece's scratch


@dataclass
class _Piece:
    """Consecutive kept parameters' ranges, contiguous in the stored buffer from ``stored_start``."""

    stored_start: int  # element offset in the stored values (bf16) or codes (int8)
    numel: int = 0  # slots in the scratch: padded to whole blocks for int8
    parts: list[_Part] = field(default_factory=list)


def _plan_pieces(sizes: list[int], keep: Sequence[bool], piece_numel: int, pad: bool) -> list[_Piece]:
    """The pieces of one update: a parameter split at multiples of piece_numel from its start, kept parameters
    gathered until a piece is full; a parameter without a gradient ends a piece (the stored range must stay
    contiguous). ``pad``: a part takes whole QUANT_BLOCKs of the scratch (int8)."""
    pieces: list[_Piece] = []
    current: _Piece | None = None
    flat = stored = kept = 0
    for size, k in zip(sizes, keep, strict=True):
        stored_size = padded_numel(size) if pad else size
        if not k:
            current = None
        else:
            for start in range(0, size, piece_numel):
                end = min(size, start + piece_numel)
                slots = padded_numel(end - start) if pad else end - start
                if current is None or current.numel + slots > piece_numel:
                    current = _Piece(stored_start=stored + start)
                    pieces.append(current)
                current.parts.append(_Part(kept, start, end, flat + start, current.numel))
                current.numel += slots
            kept += 1
        flat += size
        stored += stored_size
    return pieces


def adamw_update_block(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    sizes: list[int],
    keep: Sequence[bool],
    steps: list[torch.Tensor],
    hypers: list[AdamWHyper],
    moment_dtype: str,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    scratch: MomentScratch | None = None,
    piece_numel: int | None = None,
    rounding_seed: int = 0,
) -> None:
    """One AdamW step over a block: ``master``, ``grad`` flat fp32 (``sum(sizes)``); ``exp_avg``, ``exp_avg_sq`` the
    stored buffers (:func:`moment_storage`); ``keep`` one bool a parameter: one without a gradient this step is left
    exactly as it is, its step counter too; ``steps``, ``hypers`` the kept ones' step tensors (incremented here) and
    AdamWHyper. fp32: ``adamw_update_grouped`` on per-parameter views (bit-identical). bf16, int8: piece by piece
    through an fp32 scratch (``scratch``: keep one per thread to reuse it across calls; None takes one for this
    call). ``out=(master_new, exp_avg_new, exp_avg_sq_new)``: the result lands there, every parameter's (a skipped
    one's copied), and the inputs keep their values. ``piece_numel``: elements a piece (default: per thread).
    ``rounding_seed``: the block's seed of bf16 stochastic rounding (its index; any int that stays the block's)."""
    if len(keep) != len(sizes) or sum(map(bool, keep)) != len(steps) or len(steps) != len(hypers):
        raise RuntimeError(f"adamw_update_block: {len(sizes)} sizes, {len(keep)} keep flags, "
                           f"{sum(map(bool, keep))} kept, {len(steps)} steps, {len(hypers)} hypers")
    for flat in (master, grad, *(out[:1] if out is not None else ())):
        if flat.dtype != torch.float32 or flat.numel() != sum(sizes):
            raise RuntimeError(f"adamw_update_block: master and gradient are {sum(sizes)} fp32 values, got {flat.dtype} "
                               f"{tuple(flat.shape)}")
    for stored in (exp_avg, exp_avg_sq, *(out[1:] if out is not None else ())):
        check_stored(stored, moment_dtype, sizes)
    if moment_dtype == "fp32":
        _update_fp32(master, grad, exp_avg, exp_avg_sq, sizes, keep, steps, hypers, out)
        return
    piece_numel = piece_numel or default_piece_numel()
    if piece_numel % QUANT_BLOCK:
        raise ValueError(f"piece_numel {piece_numel} is not a multiple of QUANT_BLOCK ({QUANT_BLOCK})")
    pieces = _plan_pieces(sizes, keep, piece_numel, pad=moment_dtype == "int8")
    if out is not None:
        _copy_skipped(master, exp_avg, exp_avg_sq, sizes, keep, moment_dtype, out)
    if steps:
        torch._foreach_add_(steps, 1)  # once, before every piece: the reference increments before the update
    kernel = _compiled_kernel(scratch, moment_dtype, master.device)
    if kernel is not None:
        target = out if out is not None else (master, exp_avg, exp_avg_sq)
        if moment_dtype == "int8":
            kernel.update(master, grad, exp_avg, exp_avg_sq, sizes, list(keep), steps, hypers, target)
            return
        if steps:  # bf16: the torch-ops path's bits, its rounding offsets computed here as below
            table_offsets = {kind: rounding_offsets(torch.stack(steps), rounding_seed, kind)
                             for kind in BF16_STOCHASTIC_KINDS}
            kernel.update_bf16(master, grad, exp_avg, exp_avg_sq, sizes, list(keep), steps, hypers, target,
                               table_offsets)
        return
    if not pieces:
        return
    scratch = scratch or MomentScratch(master.device)
    m32, v32, temporaries = scratch.take(max(piece.numel for piece in pieces))
    target = out if out is not None else (master, exp_avg, exp_avg_sq)
    offsets = {kind: _offsets(steps, rounding_seed, kind) for kind in BF16_STOCHASTIC_KINDS if moment_dtype == "bf16"}
    constants = _bf16_constants(steps, hypers) if moment_dtype == "bf16" else None
    for piece in pieces:
        m, v = m32[: piece.numel], v32[: piece.numel]
        _decode_piece(exp_avg, "exp_avg", moment_dtype, sizes, piece, m, temporaries)
        _decode_piece(exp_avg_sq, "exp_avg_sq", moment_dtype, sizes, piece, v, temporaries)
        if out is not None:
            first, last = piece.parts[0], piece.parts[-1]
            span = slice(first.flat, last.flat + last.end - last.start)
            out[0][span].copy_(master[span])  # kept parameters of a piece are consecutive in master too
        _update_piece(target[0], grad, m, v, piece, steps, hypers, constants, temporaries)
        _encode_piece(m, "exp_avg", moment_dtype, sizes, piece, target[1], temporaries, offsets.get("exp_avg"))
        _encode_piece(v, "exp_avg_sq", moment_dtype, sizes, piece, target[2], temporaries, offsets.get("exp_avg_sq"))


def _compiled_kernel(scratch: MomentScratch | None, moment_dtype: str, device: torch.device) -> Int8Kernel | None:
    """The compiled kernel that runs this update: the scratch's, for CPU tensors, and for bf16 only where its build's
    contraction check found the torch-ops path's bits (:attr:`Int8Kernel.bf16_exact`)."""
    kernel = scratch.int8_kernel if scratch is not None else None
    if kernel is None or device.type != "cpu" or (moment_dtype == "bf16" and not kernel.bf16_exact):
        return None
    return kernel


def _update_fp32(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 sizes: list[int], keep: Sequence[bool], steps: list[torch.Tensor], hypers: list[AdamWHyper],
                 out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    """Today's update on per-parameter views: in place, or out of place with the skipped parameters copied."""

    def views(flat: torch.Tensor) -> list[torch.Tensor]:
        return [view for view, k in zip(split_views(flat, sizes), keep, strict=True) if k]

    if out is None:
        adamw_update_grouped(views(master), views(grad), views(exp_avg), views(exp_avg_sq), steps, hypers)
        return
    _copy_skipped(master, exp_avg, exp_avg_sq, sizes, keep, "fp32", out)
    old = (views(master), views(exp_avg), views(exp_avg_sq))
    new = (views(out[0]), views(out[1]), views(out[2]))
    adamw_update_out_of_place(old, new, views(grad), steps, hypers)


def _copy_skipped(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, sizes: list[int],
                  keep: Sequence[bool], moment_dtype: str, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """A skipped parameter's master and stored moment bytes copied to ``out`` unchanged (codes and scales for int8),
    and an int8 buffer's alignment tail: ``out`` ends byte for byte what an in-place update leaves."""
    if moment_dtype == "int8":
        tail = int8_tail(sizes)
        out[1][tail:].copy_(exp_avg[tail:])
        out[2][tail:].copy_(exp_avg_sq[tail:])
    if all(keep):
        return
    for source, target, k in zip(split_views(master, sizes), split_views(out[0], sizes), keep, strict=True):
        if not k:
            target.copy_(source)
    for source, target in ((exp_avg, out[1]), (exp_avg_sq, out[2])):
        if moment_dtype != "int8":
            for old, new, k in zip(split_views(source, sizes), split_views(target, sizes), keep, strict=True):
                if not k:
                    new.copy_(old)
            continue
        (codes, scales), (new_codes, new_scales) = int8_views(source, sizes), int8_views(target, sizes)
        code_start = 0
        for size, k in zip(sizes, keep, strict=True):
            slots = padded_numel(size)
            if not k:
                new_codes[code_start : code_start + slots].copy_(codes[code_start : code_start + slots])
                block = slice(code_start // QUANT_BLOCK, (code_start + slots) // QUANT_BLOCK)
                new_scales[block].copy_(scales[block])
            code_start += slots


def _decode_piece(stored: torch.Tensor, kind: str, moment_dtype: str, sizes: list[int], piece: _Piece,
                  values: torch.Tensor, temporaries: DecodeScratch) -> None:
    span = slice(piece.stored_start, piece.stored_start + piece.numel)
    if moment_dtype == "bf16":
        values.copy_(stored[span])  # widening is exact
        return
    codes, scales = int8_views(stored, sizes)
    blocks = slice(span.start // QUANT_BLOCK, span.stop // QUANT_BLOCK)
    decode_into(codes[span], scales[blocks], kind, values, temporaries)


def _offsets(steps: list[torch.Tensor], seed: int, kind: str) -> list[tuple[int, int]] | torch.Tensor:
    """Each kept parameter's table offsets of bf16 stochastic rounding: Python ints for CPU steps (the tables are
    sliced), a device tensor for CUDA ones (gathered: no sync)."""
    offsets = rounding_offsets(torch.stack(steps), seed, kind)
    if offsets.device.type == "cpu":
        return [(o1, o2) for o1, o2 in offsets.tolist()]
    return offsets


def _encode_piece(values: torch.Tensor, kind: str, moment_dtype: str, sizes: list[int], piece: _Piece,
                  stored: torch.Tensor, temporaries: DecodeScratch,
                  offsets: list[tuple[int, int]] | torch.Tensor | None = None) -> None:
    span = slice(piece.stored_start, piece.stored_start + piece.numel)
    if moment_dtype == "bf16":
        if offsets is None:
            stored[span].copy_(values)  # round to nearest even
            return
        bits = temporaries.tmp[: piece.numel].view(torch.int32)  # int8's temporaries, free under bf16
        for part in piece.parts:  # each parameter's elements with its own step's bits
            length = part.end - part.start
            rounding_bits(part.flat, offsets[part.kept], bits[part.local : part.local + length])
        round_bf16_stochastic(values, bits, stored[span])
        return
    codes, scales = int8_views(stored, sizes)
    blocks = slice(span.start // QUANT_BLOCK, span.stop // QUANT_BLOCK)
    encode_from(values, kind, codes[span], scales[blocks], temporaries)


def _update_piece(master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, piece: _Piece,
                  steps: list[torch.Tensor], hypers: list[AdamWHyper], constants: list[tuple[Bf16Constant, ...]] | None,
                  temporaries: DecodeScratch) -> None:
    """A piece's AdamW: bf16's own sequence where its ``constants`` are given, else (int8) torch's fused AdamW."""
    if constants is not None:
        _bf16_piece(master, grad, m, v, piece, constants, temporaries)
    else:
        _fused_piece(master, grad, m, v, piece, steps, hypers)


def _fused_piece(master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, piece: _Piece,
                 steps: list[torch.Tensor], hypers: list[AdamWHyper]) -> None:
    """int8's update: torch's fused AdamW on the piece's per-parameter sub-views, one call per distinct
    hyper-parameter setting (as ``adamw_update_grouped``); the steps were incremented already."""
    groups: dict[AdamWHyper, list[_Part]] = {}
    for part in piece.parts:
        groups.setdefault(hypers[part.kept], []).append(part)
    for hyper, parts in groups.items():
        flat = [slice(p.flat, p.flat + p.end - p.start) for p in parts]
        local = [slice(p.local, p.local + p.end - p.start) for p in parts]
        torch._fused_adamw_(
            [master[s] for s in flat], [grad[s] for s in flat], [m[s] for s in local], [v[s] for s in local], [],
            [steps[p.kept] for p in parts],
            lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay, eps=hyper.eps,
            amsgrad=False, maximize=False,
        )


def _bf16_constants(steps: list[torch.Tensor], hypers: list[AdamWHyper]) -> list[tuple[Bf16Constant, ...]]:
    """Each kept parameter's ``adam.BF16_CONSTANTS`` at its step (incremented already). CPU steps: read, and
    ``bf16_update_constants`` in Python doubles, as the compiled kernel takes them. CUDA steps: the step-dependent
    two computed on the device in float64 from the counters and rounded to fp32 there (reading the counters would
    wait for the device); ``beta ** step`` there may differ from the CPU's in a double's last bit, which moves the
    fp32 constant only where it lies that close to a rounding boundary (CPU and CUDA runs are close, not equal)."""
    if not steps:
        return []
    if steps[0].device.type == "cpu":
        return [bf16_update_constants(h, t) for h, t in zip(hypers, torch.stack(steps).tolist(), strict=True)]
    return _bf16_constants_on_device(steps, hypers)


def _bf16_constants_on_device(steps: list[torch.Tensor], hypers: list[AdamWHyper]) -> list[tuple[Bf16Constant, ...]]:
    """``_bf16_constants`` without reading the counters: the step-dependent two as 0-dim fp32 tensors of the steps'
    device, ``adam.bf16_step_constants``' formula (the Python doubles' operations in their order) in float64 there,
    then rounded once (one computation per distinct hyper-parameter setting)."""
    t = torch.stack(steps).to(torch.float64)
    per_hyper = {h: tuple(c.float() for c in bf16_step_constants(h, t)) for h in set(hypers)}
    constants: list[tuple[Bf16Constant, ...]] = []
    for k, h in enumerate(hypers):
        fixed = bf16_update_constants(h, 1.0)  # the step-independent ones (step_size and inv_bias_root replaced)
        step_size, inv_bias_root = per_hyper[h]
        constants.append((*fixed[:5], step_size[k], inv_bias_root[k], fixed[7]))
    return constants


def _bf16_piece(master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, piece: _Piece,
                constants: list[tuple[Bf16Constant, ...]], temporaries: DecodeScratch) -> None:
    """bf16's AdamW step (the module's sequence of single fp32 operations, each rounded on its own) on the piece's
    runs of consecutive parameters with equal constants (one op sequence a run): master in place, ``m``, ``v`` the
    piece's widened moments; the steps were incremented already (``bf16_arith.bf16_ops_step``). The root's float64
    values live in ``temporaries.tmp`` (free then)."""
    for flat, local, constants_of_run in _bf16_runs(piece, constants):
        bf16_ops_step(master[flat], grad[flat], m[local], v[local], constants_of_run, temporaries.tmp[local],
                      temporaries.tmp2[local], temporaries.tmp)


def _bf16_runs(piece: _Piece, constants: list[tuple[Bf16Constant, ...]]
               ) -> list[tuple[slice, slice, tuple[Bf16Constant, ...]]]:
    """(master slice, scratch slice, constants) of each run of the piece's consecutive parts whose constants are
    equal Python floats (a piece's parts are consecutive in master and in the scratch: bf16 pads nothing); a part
    with device constants is a run of its own (comparing them would wait for the device)."""
    runs: list[tuple[slice, slice, tuple[Bf16Constant, ...]]] = []
    previous: tuple[Bf16Constant, ...] | None = None
    for part in piece.parts:
        length = part.end - part.start
        current = constants[part.kept]
        mergeable = not any(isinstance(c, torch.Tensor) for c in current)
        if runs and mergeable and previous == current and (runs[-1][0].stop, runs[-1][1].stop) == (part.flat, part.local):
            flat, local, _ = runs[-1]
            runs[-1] = (slice(flat.start, part.flat + length), slice(local.start, part.local + length), current)
        else:
            runs.append((slice(part.flat, part.flat + length), slice(part.local, part.local + length), current))
        previous = current if mergeable else None
    return runs
