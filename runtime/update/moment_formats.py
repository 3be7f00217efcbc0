"""How Adam's moments are stored (``optimizer.moment_dtype``): fp32, bf16, or 8-bit blockwise codes with scales.

Owns: the byte layout of one stored moment of a block (:func:`moment_storage`), the all-zero state, and the
conversions between a stored moment and fp32 values, whole (:func:`decode_moment`, :func:`encode_moment`, for
checkpoints and ``state_dict``) and by piece (:func:`decode_into`, :func:`encode_from`, what the update runs).
Leaves out: the AdamW step over these formats (``runtime.update.moments``). Device-agnostic torch: the same code
runs on CPU and CUDA tensors; no Python per element.

fp32: the values (exactly today's state). bf16: the values in bfloat16; widening back is exact. How the update
narrows them (:func:`round_bf16_stochastic`, [Note: bf16 stochastic rounding] below): ``exp_avg_sq`` by stochastic
rounding, ``exp_avg`` to nearest even (``runtime.update.moments.BF16_STOCHASTIC_KINDS``); conversions outside the
update (checkpoints across formats, ``load_state_dict``) round to nearest even. Why: with beta2 0.999 a step changes
v by 0.1% (decay), below half a bf16 ulp (0.2-0.4%), so a v rounded to nearest cannot decay and rises only under a
gradient ~3x its root; v reads high, steps run small. Stochastic rounding rounds up with probability the distance
to the value below over the ulp, so the decay is kept on average. Its random bits depend only on the element's
index in its block, its step, the block's seed and the kind: deterministic, nothing to checkpoint, the same on CPU
and CUDA. Measured on the tiny ExampleLM (byte tokens, lr 3e-3, held-out loss against fp32 moments;
tests/unit/runtime/update/test_moments_quality.py): after 200 steps nearest rounding +0.97%, stochastic (v) +0.07%,
-0.24%, +0.11% over three block seeds (v and m both stochastic: +0.59% to -0.40% over five), int8 +0.02%; after
1,000 steps nearest -0.82%, stochastic (v) +0.31%, +0.35% (v and m: +0.18%, +0.29%, -0.04%), int8 +0.16%. The
cost, on one core (7.1 M parameters, ``adam_bench --threads 1``; the torch-ops update when it ran torch's fused AdamW,
before bf16's own arithmetic: ``runtime.update.moments``): the bf16 update 0.56x fp32's parameters/s with
nearest rounding, 0.40x with v stochastic, 0.28x with both (two more int32 passes and an XOR over each piece's
v).

int8 (``uint8`` buffer): each parameter's values are cut into blocks of :data:`QUANT_BLOCK`, and a block's codes
are relative to its own scale ``s`` (its largest magnitude, at least :data:`MIN_SCALE`). A parameter's blocks never
hold another parameter's values (its codes are padded to a block multiple with zero codes), so updating one
parameter never changes another's bytes. Layout: every parameter's padded codes in order, then one fp32 scale per
block, the total rounded up to 64 bytes.

- ``exp_avg`` (signed): ``c = round(127 * sign(m) * sqrt(|m| / s))``, ``m' = sign(c) * s * (c / 127)^2``, an int8
  code. A linear code (``s / 127`` a step) loses every value below ``s / 254`` in the block to zero, and an element
  whose gradients stay small against its block's largest never moves again (its ``m`` rounds back to zero each
  step); the square-root companding keeps values down to ``s / 64516`` with a relative error of about
  ``(1/127) * sqrt(s / |m|)``. Per block: ``|m - m'| <= sqrt(s * |m|) / 127 + s / 64516``.
- ``exp_avg_sq`` (non-negative, many decades in one block): ``c = round(255 * (v / s)^(1/4))``, raised to 1 for
  any ``v > 0``; ``v' = s * (c / 255)^4``. AdamW divides by ``sqrt(v') + eps``, so what matters is ``sqrt(v')``,
  linear in ``c^2``: its relative error is about ``1 / c``, over 9 decades of ``v`` below the block's largest.
  A zero code under a non-zero ``m`` would divide by ``eps`` alone and make a huge step: no positive ``v`` gets
  code 0, and rounding never underestimates ``sqrt(v)`` by more than the factor ``(c / (c + 0.5))^2 >= 4/9``, so
  a step is at most 2.25x its fp32 size, and that only for ``v`` below ``1.2e-9`` of its block's largest (at most
  1.1x for ``v`` above ``1e-5`` of it). Rounding up always (``ceil``) would be safer still, but every block is
  encoded again each step, so an upward rounding ratchets: a ``v`` that decays (0.1% a step with beta2 0.999,
  smaller than a code's step) could never come down. Nearest rounding sticks too, both ways, for changes under half
  a code (as in 8-bit Adam): the block's fp32 scale carries what the block's values do together. Per block:
  ``|sqrt(v) - sqrt(v')| <= (s * v)^(1/4) / 255 + sqrt(s) / 255^2``.
- :data:`QUANT_BLOCK` = 2048 values a scale: bitsandbytes' block for its 8-bit optimizers; the scales cost 4 bytes
  in 2048 (0.2%), and a parameter's padding at most 2047 bytes (a 4096-wide norm weight: none).
- :data:`MIN_SCALE` = 2^-90: every decode factor (``s / 127^2``, ``s / 255^4``) stays a normal float, so a block of
  tiny or denormal values keeps the bound above; values that small (``m`` below 1e-27, ``sqrt(v)`` below 3e-14,
  far below AdamW's eps) do not move a weight.

Non-finite values are not representable: a block holding one decodes to NaN (the fp32 update would carry it too).
"""

from __future__ import annotations

import torch

from runtime.planning.moment_sizes import INT8_ALIGN, MOMENT_DTYPES, QUANT_BLOCK, stored_moment_nbytes

MOMENT_KINDS = ("exp_avg", "exp_avg_sq")
MIN_SCALE = 2.0**-90
# The formats, the block and the alignment are planning's (it counts the bytes before anything is allocated, and sits
# below this package): one definition of the layout's sizes.
STORE_ALIGN = INT8_ALIGN  # bytes: an int8 moment's buffer is a whole number of cache lines

_M_LEVELS = 127.0  # int8 codes -127..127 (-128 unused: the map is symmetric)
_V_LEVELS = 255.0  # uint8 codes 0..255


def _check(moment_dtype: str, kind: str | None = None) -> None:
    if moment_dtype not in MOMENT_DTYPES:
        raise ValueError(f"moment_dtype {moment_dtype!r} is not one of {MOMENT_DTYPES} (optimizer.moment_dtype)")
    if kind is not None and kind not in MOMENT_KINDS:
        raise ValueError(f"moment kind {kind!r} is not one of {MOMENT_KINDS}")


def padded_numel(numel: int) -> int:
    """Element slots a parameter of ``numel`` values takes in an int8 moment: a whole number of blocks."""
    return -(-numel // QUANT_BLOCK) * QUANT_BLOCK


def int8_layout(sizes: list[int]) -> tuple[int, int, int]:
    """(codes nbytes, number of blocks, total nbytes) of an int8 moment of parameters with ``sizes`` elements."""
    codes_nbytes = sum(padded_numel(size) for size in sizes)
    num_blocks = codes_nbytes // QUANT_BLOCK
    total = codes_nbytes + 4 * num_blocks
    return codes_nbytes, num_blocks, -(-total // STORE_ALIGN) * STORE_ALIGN


def int8_tail(sizes: list[int]) -> int:
    """Byte offset of an int8 moment's alignment tail (after the scales; never read)."""
    codes_nbytes, num_blocks, _ = int8_layout(sizes)
    return codes_nbytes + 4 * num_blocks


def moment_storage(moment_dtype: str, sizes: list[int]) -> tuple[torch.dtype, int]:
    """(dtype, numel) of the one flat buffer that holds one moment (``exp_avg`` or ``exp_avg_sq``) of a block whose
    parameters have ``sizes`` elements. fp32: (float32, sum); bf16: (bfloat16, sum); int8: (uint8, bytes) holding
    each parameter's codes padded to a :data:`QUANT_BLOCK` multiple, then the per-block fp32 scales, the total a
    multiple of 64 bytes."""
    _check(moment_dtype)
    if moment_dtype == "fp32":
        return torch.float32, sum(sizes)
    if moment_dtype == "bf16":
        return torch.bfloat16, sum(sizes)
    return torch.uint8, int8_layout(sizes)[2]


def moment_nbytes(moment_dtype: str, sizes: list[int]) -> int:
    """Bytes of one stored moment of a block whose parameters have ``sizes`` elements (planning's count)."""
    _check(moment_dtype)
    return stored_moment_nbytes(moment_dtype, sizes)


def check_stored(stored: torch.Tensor, moment_dtype: str, sizes: list[int]) -> None:
    """Refuse (RuntimeError: a broken invariant, not a user's setting) a buffer that is not a stored moment of this
    format and these sizes."""
    dtype, numel = moment_storage(moment_dtype, sizes)
    if stored.dtype != dtype or stored.numel() != numel or stored.dim() != 1:
        raise RuntimeError(f"a stored {moment_dtype} moment of {len(sizes)} parameters must be 1-D {dtype} of "
                           f"{numel} elements, got {stored.dtype} {tuple(stored.shape)}")


def int8_views(stored: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as uint8, scales as float32) views of a stored int8 moment."""
    codes_nbytes, num_blocks, _ = int8_layout(sizes)
    return stored[:codes_nbytes], stored[codes_nbytes : codes_nbytes + 4 * num_blocks].view(torch.float32)


def zero_moments(stored: torch.Tensor, moment_dtype: str, sizes: list[int]) -> None:
    """Write the initial (all-zero) state of a moment into ``stored``: zero values, zero codes, zero scales."""
    check_stored(stored, moment_dtype, sizes)
    stored.zero_()


class DecodeScratch:
    """Two temporaries of one piece for the int8 maps (allocated once per update, reused by every piece)."""

    def __init__(self, numel: int, device: torch.device):
        self.tmp = torch.empty(numel, dtype=torch.float32, device=device)
        self.tmp2 = torch.empty(numel, dtype=torch.float32, device=device)


# Added to exp_avg's t = |m| / s before its rsqrt: keeps m * rsqrt(t) finite (zero) at m = 0, and changes no code
# (a t below 1.5e-5 has code 0; the relative change of sqrt(t) is below 1e-25 / t).
_T_FLOOR = 1e-30


def decode_into(codes: torch.Tensor, scales: torch.Tensor, kind: str, values: torch.Tensor,
                scratch: DecodeScratch) -> None:
    """fp32 values of int8 ``codes`` (uint8 bytes, a whole number of blocks) with their ``scales`` into ``values``
    (as many elements as codes)."""
    blocks = values.view(-1, QUANT_BLOCK)
    if kind == "exp_avg":
        values.copy_(codes.view(torch.int8))
        values.mul_(torch.abs(values, out=scratch.tmp[: values.numel()]))  # c * |c|: the square, signed
        blocks.mul_((scales / (_M_LEVELS * _M_LEVELS)).unsqueeze(1))
    else:
        values.copy_(codes)
        values.square_().square_()  # c^4 (exact to fp32 rounding)
        blocks.mul_((scales / _V_LEVELS**4).unsqueeze(1))


def _finite_or_nan(scale: torch.Tensor) -> torch.Tensor:
    """Block scales with an infinite one made NaN (in place): the block then decodes to NaN whatever its codes. An
    infinite scale would decode codes 0 to NaN and the rest to infinities (v's positive values get code 1 at
    least), which AdamW turns into steps of 0: a silently frozen block instead of the NaN fp32 moments carry."""
    return scale.masked_fill_(scale.isinf(), float("nan"))


def encode_from(values: torch.Tensor, kind: str, codes: torch.Tensor, scales: torch.Tensor,
                scratch: DecodeScratch) -> None:
    """int8 codes and block scales of fp32 ``values`` (a whole number of blocks; padding slots hold zeros).

    Roots as rsqrt (half the cost of sqrt in torch's CPU kernels): exp_avg's ``127 sign(m) sqrt(|m| / s)`` is
    ``m rsqrt(|m| / s) 127 / s``, exp_avg_sq's ``(v / s)^(1/4)`` is ``rsqrt(rsqrt(v / s))`` (0 -> inf -> 0). The codes
    leave through an int32 view of a temporary: torch converts fp32 to uint8 without vector instructions."""
    n = values.numel()
    y, integers = scratch.tmp[:n], scratch.tmp2[:n]
    y_blocks = y.view(-1, QUANT_BLOCK)
    if kind == "exp_avg":
        torch.abs(values, out=y)
        scale = _finite_or_nan(torch.amax(y_blocks, dim=1).clamp_min_(MIN_SCALE))
        inverse = scale.reciprocal().unsqueeze(1)
        y_blocks.mul_(inverse)
        y.add_(_T_FLOOR).rsqrt_().mul_(values)  # sign(m) sqrt(|m| s): at most s, no overflow
        y_blocks.mul_(inverse * _M_LEVELS)
        y.round_()  # |y| <= 127 up to a few ulps: rounds to 127 at most
        codes.view(torch.int8).copy_(y)
    else:
        scale = _finite_or_nan(torch.amax(values.view(-1, QUANT_BLOCK), dim=1).clamp_min_(MIN_SCALE))
        torch.mul(values.view(-1, QUANT_BLOCK), scale.reciprocal().unsqueeze(1), out=y_blocks)
        y.rsqrt_().rsqrt_().mul_(_V_LEVELS).round_()
        # A positive v never gets code 0 (sign is 1 there, 0 for v == 0): AdamW would divide its m by eps alone.
        torch.maximum(y, torch.sign(values, out=integers), out=y)
        codes.copy_(integers.view(torch.int32).copy_(y))
    scales.copy_(scale)


# [Note: bf16 stochastic rounding] A bf16 moment is narrowed by stochastic rounding in the update: 16 random bits are
# added below bf16's mantissa in the fp32 bit pattern and the sum truncated, so a value rounds up with probability
# its distance from the bf16 value below over the step between them, and a decay smaller than half a step is kept on
# average. The bits are a function of the element's index ``i`` in its block's flat buffer and a salt of (its
# parameter's step counter after the increment, the block's seed, the moment kind), nothing else: no RNG state to
# checkpoint (a resumed run rounds as the uninterrupted one), the same bits whatever the piece size or thread count.
# ``bits(i) = T1[(i + o1) % P1] ^ T2[(i + o2) % P2]``: two fixed tables of 16-bit hashes (``mix32`` of their
# positions) of prime lengths P1, P2, at offsets ``o1, o2`` hashed from the salt. A hash per element (a dozen int64
# passes) made the bf16 update 8x slower; the tables cost two copies and an XOR of contiguous slices (on the CPU,
# where the offsets are Python ints) or two gathers (on CUDA, where the steps stay device tensors: no sync). Elements
# share one table's bits only P1 (or P2) apart, and then XOR independent bits of the other table; an element's bits
# repeat across steps only when both offsets do. The integer ops never overflow (32-bit values times constants below
# 2^31 in int64), so CPU and CUDA compute the same tables and offsets.
_MASK32 = 0xFFFFFFFF
_MIX1, _MIX2 = 0x7FEB352D, 0x2C1B3C6D  # odd multipliers below 2^31 (the first is lowbias32's)
_KIND_BITS = {"exp_avg": 1, "exp_avg_sq": 2}
_TABLE_PRIMES = (65521, 65519)  # P1, P2: primes, their product (4.3e9) beyond any block's elements
_TABLE_KEYS = (0x3C6EF372, 0x1B873593)
_LOW16 = -(1 << 16)  # keeps the fp32 bits a bfloat16 holds (sign-extended: also for negative bit patterns)
_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32) (new tensor; the same ops on CPU and CUDA)."""
    x = torch.bitwise_xor(x, x >> 16).mul_(_MIX1).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15).mul_(_MIX2).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def rounding_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two int32 tables of 16-bit values, each stored twice over (``2 P`` elements) so that any ``P``
    consecutive entries from any offset are one contiguous slice; built once per device."""
    if device not in _tables:
        tables = []
        for prime, key in zip(_TABLE_PRIMES, _TABLE_KEYS, strict=True):
            table = (mix32(torch.arange(prime, dtype=torch.int64).bitwise_xor_(key)) >> 16).to(torch.int32)
            tables.append(torch.cat([table, table]).to(device))
        _tables[device] = (tables[0], tables[1])
    return _tables[device]


def rounding_offsets(steps: torch.Tensor, seed: int, kind: str) -> torch.Tensor:
    """int64 ``(len(steps), 2)``: the table offsets ``o1, o2`` of bf16 stochastic rounding for each step counter in
    ``steps`` (float or integer, on any device), a block's ``seed`` and a moment ``kind``."""
    _check("bf16", kind)
    key = mix32(torch.tensor([((seed << 2) | _KIND_BITS[kind]) & _MASK32], dtype=torch.int64)).to(steps.device)
    salt = mix32(steps.reshape(-1).to(torch.int64).bitwise_and_(_MASK32).bitwise_xor_(key))
    return torch.stack([salt % _TABLE_PRIMES[0], mix32(salt) % _TABLE_PRIMES[1]], dim=1)


def rounding_bits(start: int, offsets: torch.Tensor | tuple[int, int], out: torch.Tensor) -> None:
    """The 16 random bits (int32 ``out``) of a block's elements ``start .. start + out.numel()`` at the table
    ``offsets`` (a row of :func:`rounding_offsets`: Python ints slice the tables, a tensor gathers from them)."""
    tables = rounding_tables(out.device)
    if isinstance(offsets, torch.Tensor):
        index = torch.arange(start, start + out.numel(), dtype=torch.int64, device=out.device)
        out.copy_(tables[0][(index + offsets[0]) % _TABLE_PRIMES[0]])
        out.bitwise_xor_(tables[1][index.add_(offsets[1]).remainder_(_TABLE_PRIMES[1])])
        return
    first = (start + offsets[0]) % _TABLE_PRIMES[0]
    second = (start + offsets[1]) % _TABLE_PRIMES[1]
    done, most = 0, min(_TABLE_PRIMES)
    while done < out.numel():  # a chunk at most the shorter table: both slices lie within the doubled tables
        length = min(most, out.numel() - done)
        torch.bitwise_xor(tables[0][first : first + length], tables[1][second : second + length],
                          out=out[done : done + length])
        done += length
        first, second = (first + length) % _TABLE_PRIMES[0], (second + length) % _TABLE_PRIMES[1]


def round_bf16_stochastic(values: torch.Tensor, bits: torch.Tensor, out: torch.Tensor) -> None:
    """fp32 ``values`` stochastically rounded into bfloat16 ``out`` with their random ``bits`` (int32,
    :func:`rounding_bits`; overwritten). Finite values and infinities round as the Note says; torch's NaN (a quiet
    0x7FC00000) stays NaN, but a NaN whose top 16 mantissa bits are all ones may come out as a signed zero."""
    bits.add_(values.view(torch.int32)).bitwise_and_(_LOW16)
    out.copy_(bits.view(torch.float32))  # exact: the low 16 bits are zero (a strided copy of the high halves: 2x slower)


# Elements converted at a time by decode_moment / encode_moment (a multiple of QUANT_BLOCK): their temporaries stay
# at 3 x 4 MiB whatever the block's size (a whole block at once took three times its fp32 size).
CONVERT_CHUNK = 1 << 20


def _chunks(sizes: list[int]) -> list[tuple[int, int, int]]:
    """(flat offset, code offset, numel) of every parameter's chunks of at most CONVERT_CHUNK elements."""
    chunks, flat, code = [], 0, 0
    for size in sizes:
        for start in range(0, size, CONVERT_CHUNK):
            chunks.append((flat + start, code + start, min(CONVERT_CHUNK, size - start)))
        flat += size
        code += padded_numel(size)
    return chunks


def decode_moment(stored: torch.Tensor, moment_dtype: str, kind: str, sizes: list[int]) -> torch.Tensor:
    """fp32 flat values (``sum(sizes)``) of a stored moment; ``kind`` is "exp_avg" or "exp_avg_sq" (the int8 maps
    differ). For fp32 this is ``stored`` itself, not a copy; for the others a new tensor."""
    _check(moment_dtype, kind)
    check_stored(stored, moment_dtype, sizes)
    if moment_dtype == "fp32":
        return stored
    if moment_dtype == "bf16":
        return stored.float()
    values = torch.empty(sum(sizes), dtype=torch.float32, device=stored.device)
    codes, scales = int8_views(stored, sizes)
    padded = torch.empty(min(CONVERT_CHUNK, codes.numel()), dtype=torch.float32, device=stored.device)
    scratch = DecodeScratch(padded.numel(), stored.device)
    for flat, code, numel in _chunks(sizes):
        slots = padded_numel(numel)
        decode_into(codes[code : code + slots], scales[code // QUANT_BLOCK : (code + slots) // QUANT_BLOCK], kind,
                    padded[:slots], scratch)
        values[flat : flat + numel].copy_(padded[:numel])
    return values


def encode_moment(values_fp32: torch.Tensor, moment_dtype: str, kind: str, sizes: list[int],
                  out_stored: torch.Tensor) -> None:
    """Store fp32 flat ``values_fp32`` (``sum(sizes)``) as a moment of ``moment_dtype`` in ``out_stored``."""
    _check(moment_dtype, kind)
    check_stored(out_stored, moment_dtype, sizes)
    if values_fp32.dtype != torch.float32 or values_fp32.numel() != sum(sizes):
        raise RuntimeError(f"encode_moment takes {sum(sizes)} fp32 values, got {values_fp32.dtype} "
                           f"{tuple(values_fp32.shape)}")
    values = values_fp32.reshape(-1)
    if moment_dtype != "int8":
        out_stored.copy_(values)
        return
    codes, scales = int8_views(out_stored, sizes)
    codes.zero_()  # parameters of no elements and the padding: zero codes
    padded = torch.empty(min(CONVERT_CHUNK, codes.numel()), dtype=torch.float32, device=out_stored.device)
    scratch = DecodeScratch(padded.numel(), out_stored.device)
    for flat, code, numel in _chunks(sizes):
        slots = padded_numel(numel)
        padded[numel:slots].zero_()
        padded[:numel].copy_(values[flat : flat + numel])
        encode_from(padded[:slots], kind, codes[code : code + slots],
                    scales[code // QUANT_BLOCK : (code + slots) // QUANT_BLOCK], scratch)
