"""Stored moment formats: the buffer layout, the zero state, bf16's rounding, and the int8 maps' documented
per-block bounds over random and adversarial values (and the rule that a positive v never decodes to zero)."""

from __future__ import annotations

import pytest
import torch

from runtime.update.moment_formats import MIN_SCALE, int8_layout, int8_views
from runtime.update.moments import (
    MOMENT_DTYPES,
    QUANT_BLOCK,
    decode_moment,
    encode_moment,
    moment_nbytes,
    moment_storage,
    zero_moments,
)

SIZES = [1, 2047, 2049, 5000, 0, 4096]  # none of the odd ones a block multiple


def _stored(moment_dtype: str, sizes: list[int]) -> torch.Tensor:
    dtype, numel = moment_storage(moment_dtype, sizes)
    return torch.full((numel,), 7, dtype=dtype)  # not zero: zero_moments must write it


def test_storage_sizes_and_int8_layout():
    total = sum(SIZES)
    assert moment_storage("fp32", SIZES) == (torch.float32, total)
    assert moment_storage("bf16", SIZES) == (torch.bfloat16, total)
    assert moment_nbytes("fp32", SIZES) == 4 * total and moment_nbytes("bf16", SIZES) == 2 * total
    blocks = [1, 1, 2, 3, 0, 2]
    codes_nbytes, num_blocks, nbytes = int8_layout(SIZES)
    assert (codes_nbytes, num_blocks) == (QUANT_BLOCK * sum(blocks), sum(blocks))
    assert moment_storage("int8", SIZES) == (torch.uint8, nbytes) and moment_nbytes("int8", SIZES) == nbytes
    assert nbytes % 64 == 0 and codes_nbytes + 4 * num_blocks <= nbytes < codes_nbytes + 4 * num_blocks + 64
    assert QUANT_BLOCK % 64 == 0 and 1024 <= QUANT_BLOCK <= 8192
    # about a quarter of fp32 for a large parameter
    assert moment_nbytes("int8", [1 << 20]) / moment_nbytes("fp32", [1 << 20]) == pytest.approx(0.25, rel=0.01)
    with pytest.raises(ValueError, match="moment_dtype"):
        moment_storage("fp8", SIZES)


@pytest.mark.parametrize("moment_dtype", MOMENT_DTYPES)
@pytest.mark.parametrize("kind", ["exp_avg", "exp_avg_sq"])
def test_zero_state_decodes_to_zeros(moment_dtype, kind):
    stored = _stored(moment_dtype, SIZES)
    zero_moments(stored, moment_dtype, SIZES)
    values = decode_moment(stored, moment_dtype, kind, SIZES)
    assert values.dtype == torch.float32 and values.shape == (sum(SIZES),) and not values.any()


def test_fp32_round_trip_is_the_buffer_and_bf16_rounds_to_nearest_even():
    torch.manual_seed(0)
    values = torch.randn(sum(SIZES))
    stored = _stored("fp32", SIZES)
    encode_moment(values, "fp32", "exp_avg", SIZES, stored)
    assert decode_moment(stored, "fp32", "exp_avg", SIZES) is stored and torch.equal(stored, values)
    stored = _stored("bf16", SIZES)
    encode_moment(values, "bf16", "exp_avg_sq", SIZES, stored)
    assert torch.equal(decode_moment(stored, "bf16", "exp_avg_sq", SIZES), values.bfloat16().float())
    # round to nearest, ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7, and goes to 1 (even)
    tie = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20], dtype=torch.float32)
    stored = torch.empty(3, dtype=torch.bfloat16)
    encode_moment(tie, "bf16", "exp_avg", [3], stored)
    assert stored.float().tolist() == [1.0, 1 + 2**-6, 1 + 2**-7]


def _block_scales(values: torch.Tensor, sizes: list[int], signed: bool) -> torch.Tensor:
    """Each value's block scale as the docstring defines it: its block's largest magnitude, at least MIN_SCALE."""
    scales, offset = [], 0
    for size in sizes:
        part = values[offset : offset + size]
        for start in range(0, size, QUANT_BLOCK):
            block = part[start : start + QUANT_BLOCK]
            peak = (block.abs() if signed else block).max().clamp_min(MIN_SCALE)
            scales.append(peak.expand(block.numel()))
        offset += size
    return torch.cat(scales) if scales else torch.zeros(0)


def _adversarial(sizes: list[int], signed: bool) -> dict[str, torch.Tensor]:
    total = sum(sizes)
    gen = torch.Generator().manual_seed(3)
    normal = torch.randn(total, generator=gen)
    wide = torch.exp(torch.empty(total).uniform_(-60, 20, generator=gen))  # 35 decades in one block
    huge = torch.full((total,), 1e-3)
    huge[::3000] = 1e30
    cases = {
        "normal": normal,
        "wide": wide,
        "zeros": torch.zeros(total),
        "one huge value": huge,
        "denormals": torch.full((total,), 1e-41) * torch.rand(total, generator=gen),
        "equal": torch.full((total,), 0.37),
        "tiny and normal": torch.where(torch.rand(total, generator=gen) < 0.5, wide * 1e-30, normal.abs()),
    }
    if signed:
        sign = torch.where(torch.rand(total, generator=gen) < 0.5, -1.0, 1.0)
        cases = {name: v * sign for name, v in cases.items()}
    else:
        cases = {name: v.abs() ** 2 if name == "normal" else v.abs() for name, v in cases.items()}
    return cases


def _int8_round_trip(values: torch.Tensor, kind: str, sizes: list[int]) -> torch.Tensor:
    stored = _stored("int8", sizes)
    zero_moments(stored, "int8", sizes)
    encode_moment(values, "int8", kind, sizes, stored)
    return decode_moment(stored, "int8", kind, sizes)


@pytest.mark.parametrize("case", list(_adversarial(SIZES, True)))
def test_int8_exp_avg_round_trip_within_the_documented_bound(case):
    """|m - m'| <= sqrt(s |m|) / 127 + s / 64516 per block (s its scale), with the sign kept."""
    values = _adversarial(SIZES, True)[case]
    decoded = _int8_round_trip(values, "exp_avg", SIZES)
    s = _block_scales(values, SIZES, signed=True).double()
    error = (decoded.double() - values.double()).abs()
    bound = (s * values.double().abs()).sqrt() / 127 + s / 64516
    assert (error <= bound * (1 + 1e-5) + 1e-45).all(), f"{case}: worst {(error / bound).max():.4f} of the bound"
    assert not (decoded * values < 0).any()  # never the wrong sign
    if case == "equal":
        assert torch.allclose(decoded, values, rtol=1e-6, atol=0)
    if case == "zeros":
        assert not decoded.any()


@pytest.mark.parametrize("case", list(_adversarial(SIZES, False)))
def test_int8_exp_avg_sq_round_trip_within_the_documented_bound(case):
    """|sqrt(v) - sqrt(v')| <= (s v)^(1/4) / 255 + sqrt(s) / 255^2 per block; a positive v never decodes to zero, and
    sqrt(v') >= (4/9) sqrt(v): AdamW's step is never more than 2.25x its fp32 size."""
    values = _adversarial(SIZES, False)[case]
    decoded = _int8_round_trip(values, "exp_avg_sq", SIZES)
    assert (decoded >= 0).all()
    s = _block_scales(values, SIZES, signed=False).double()
    root, decoded_root = values.double().sqrt(), decoded.double().sqrt()
    bound = (s * values.double()) ** 0.25 / 255 + s.sqrt() / 255**2
    error = (decoded_root - root).abs()
    assert (error <= bound * (1 + 1e-5)).all(), f"{case}: worst {(error / bound).max():.4f} of the bound"
    assert (decoded[values > 0] > 0).all()
    assert (decoded_root >= root * (4 / 9) * (1 - 1e-6)).all()
    if case == "zeros":
        assert not decoded.any()


def test_int8_keeps_small_values_a_linear_code_would_zero():
    """Values 1/1000 of their block's largest survive with a few percent error (a linear absmax/127 code gives 0
    below 1/254), so an element with small gradients beside a large one still moves."""
    values = torch.full((QUANT_BLOCK,), 1e-3)
    values[0] = 1.0
    values[1::2] *= -1
    decoded = _int8_round_trip(values, "exp_avg", [QUANT_BLOCK])
    assert torch.allclose(decoded[2:], values[2:], rtol=0.05)
    squares = values**2
    decoded = _int8_round_trip(squares, "exp_avg_sq", [QUANT_BLOCK])
    assert torch.allclose(decoded[2:].sqrt(), squares[2:].sqrt(), rtol=0.05)


@pytest.mark.parametrize("kind", ["exp_avg", "exp_avg_sq"])
def test_int8_parameters_never_share_a_block(kind):
    """Changing one parameter's values changes none of another's bytes (codes and scales)."""
    torch.manual_seed(1)
    sizes = [100, 3000, 50]
    values = torch.rand(sum(sizes))
    before, after = _stored("int8", sizes), _stored("int8", sizes)
    for stored in (before, after):
        zero_moments(stored, "int8", sizes)
    encode_moment(values, "int8", kind, sizes, before)
    changed = values.clone()
    changed[100:3100] *= 1000.0  # the middle parameter's largest value moves every block scale it has
    encode_moment(changed, "int8", kind, sizes, after)
    codes_before, scales_before = int8_views(before, sizes)
    codes_after, scales_after = int8_views(after, sizes)
    assert torch.equal(codes_before[:2048], codes_after[:2048]) and torch.equal(codes_before[6144:], codes_after[6144:])
    assert scales_before[0] == scales_after[0] and scales_before[3] == scales_after[3]
    assert not torch.equal(scales_before[1:3], scales_after[1:3])
    assert not codes_before[2048:6144][3000:].any() and not codes_before[:2048][100:].any()  # padding stays zero


def test_buffers_of_the_wrong_shape_are_refused():
    with pytest.raises(RuntimeError, match="int8"):
        zero_moments(torch.zeros(10, dtype=torch.uint8), "int8", [10])
    with pytest.raises(RuntimeError, match="fp32 values"):
        encode_moment(torch.zeros(9), "bf16", "exp_avg", [10], torch.zeros(10, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="kind"):
        decode_moment(torch.zeros(10), "fp32", "exp_avg_sqr", [10])


@pytest.mark.parametrize("kind", ["exp_avg", "exp_avg_sq"])
def test_int8_conversion_by_chunks_equals_one_pass(kind, monkeypatch):
    """decode_moment and encode_moment convert a parameter in chunks of CONVERT_CHUNK (their temporaries stay small
    for any block): the bytes and values are those of converting it whole."""
    import runtime.update.moment_formats as formats

    torch.manual_seed(2)
    sizes = [3 * QUANT_BLOCK + 5, 10, 2 * QUANT_BLOCK]
    values = torch.randn(sum(sizes)).abs()
    whole, chunked = _stored("int8", sizes), _stored("int8", sizes)
    encode_moment(values, "int8", kind, sizes, whole)
    monkeypatch.setattr(formats, "CONVERT_CHUNK", QUANT_BLOCK)
    encode_moment(values, "int8", kind, sizes, chunked)
    tail = formats.int8_tail(sizes)
    assert torch.equal(whole[:tail], chunked[:tail])
    decoded = decode_moment(chunked, "int8", kind, sizes)
    monkeypatch.setattr(formats, "CONVERT_CHUNK", 1 << 20)
    assert torch.equal(decoded, decode_moment(whole, "int8", kind, sizes))
