"""The compiled kernel's bf16 update (``adamw_bf16``: bf16's own sequence of single fp32 operations on widened
moments, compiled without contraction, narrowed as the torch-ops path narrows): bit for bit the torch-ops path and
the plain-ops reference (tests/bf16_reference.py), over several steps, every chunk size (a parameter split into
chunks with a remainder, several parameters per call, parameters shorter than a vector or a run), out of place,
skipped parameters, any thread count. Its GIL-free run:
test_moments_kernel's. Slow: the first build takes a minute (cached after)."""

from __future__ import annotations

import logging

import pytest
import torch

from runtime.update import moment_kernel
from runtime.update.bf16_arith import bf16_ops_step
from runtime.update.moment_kernel import BF16_CHUNK, contraction_probe
from runtime.update.moments import Int8Kernel, MomentScratch
from tests.unit.runtime.update.test_moments_update import HYPERS, SIZES, Block, _grads, _reference_step

pytestmark = pytest.mark.slow

# Chunks: the default (parameter 1's 70001 values split into 65536 and a remainder of 4465, not a multiple of a
# vector or of the kernel's run of 1024), 64 (the smallest: every parameter in many chunks), and one of 3 * 64 that is
# not a power of two.
CHUNKS = [BF16_CHUNK, 64, 192]


@pytest.fixture(scope="module")
def kernel() -> Int8Kernel:
    built = Int8Kernel.build()
    assert built is not None, "the moment kernel did not build (see the log): a C++ compiler is needed"
    return built


class ChunkedKernel(Int8Kernel):
    """The built kernel, its bf16 update run with chunks of ``chunk`` values."""

    def __init__(self, built: Int8Kernel, chunk: int):  # no build: the module is the built one's
        self._module, self.chunk, self.bf16_exact = built._module, chunk, built.bf16_exact

    def update_bf16(self, *args, **kwargs) -> None:
        super().update_bf16(*args, **kwargs, chunk=self.chunk)


# Block layouts: test_moments_update's six parameters, and one of a long parameter (many chunks, a remainder of
# 200003 - 3 * 65536 = 3395 values, not a multiple of a piece, a vector or a run) between two short ones.
LAYOUTS = {"six": (SIZES, HYPERS), "long": ([7, 200_003, 64], [HYPERS[0], HYPERS[2], HYPERS[4]])}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_kernel_equals_the_torch_ops_path_and_the_reference_bit_for_bit(kernel, chunk, threads, layout):
    sizes, hypers = LAYOUTS[layout]
    calls = []
    chunked = ChunkedKernel(kernel, chunk)
    real = chunked.update_bf16
    chunked.update_bf16 = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)  # type: ignore[method-assign]
    by_kernel = Block("bf16", sizes, seed=3)
    by_ops, ref = by_kernel.clone(), by_kernel.clone()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(1, 6):
            grad = _grads(step, sizes)
            keep = [True, step != 3, step % 2 == 0, True, True, step != 2][: len(sizes)]
            by_kernel.update(grad, keep, hypers, scratch=MomentScratch(int8_kernel=chunked))
            by_ops.update(grad, keep, hypers, piece_numel=8 * 2048)  # pieces that split the long parameters too
            _reference_step(ref, grad, keep, hypers)
            assert by_kernel.same(by_ops), f"step {step}"
            assert by_kernel.same(ref), f"step {step}"
    finally:
        torch.set_num_threads(previous)
    assert len(calls) == 5  # every step ran the kernel
    assert by_kernel.exp_avg_sq.float().abs().sum() > 0 and float(by_kernel.steps[2]) == 2.0  # kept steps 2 and 4


def test_the_block_seed_reaches_the_rounding(kernel):
    """The block's rounding seed picks the stochastic-rounding bits, as in the torch-ops path: other seeds, other
    exp_avg_sq bits, each equal to the torch-ops path's under the same seed."""
    results = []
    for seed in (0, 7):
        by_kernel = Block("bf16", SIZES, seed=1)
        by_ops = by_kernel.clone()
        for step in range(1, 3):
            grad = _grads(step)
            by_kernel.update(grad, [True] * len(SIZES), HYPERS, scratch=MomentScratch(int8_kernel=kernel),
                             rounding_seed=seed)
            by_ops.update(grad, [True] * len(SIZES), HYPERS, rounding_seed=seed)
        assert by_kernel.same(by_ops), f"seed {seed}"
        results.append(by_kernel.exp_avg_sq)
    assert not torch.equal(results[0], results[1])


@pytest.mark.parametrize("keep", [[True] * 6, [True, False, True, True, False, True], [False] * 6])
def test_bf16_kernel_out_of_place_leaves_the_inputs_and_lands_the_in_place_result(kernel, keep):
    block = Block("bf16", SIZES, seed=2)
    block.update(_grads(1), [True] * len(SIZES), HYPERS)
    in_place, before = block.clone(), block.clone()
    grad = _grads(2)
    in_place.update(grad, keep, HYPERS, scratch=MomentScratch(int8_kernel=kernel))
    out = tuple(torch.full_like(t, 3) for t in (block.master, block.exp_avg, block.exp_avg_sq))
    block.update(grad, keep, HYPERS, out=out, scratch=MomentScratch(int8_kernel=kernel))
    assert torch.equal(block.master, before.master) and torch.equal(block.exp_avg, before.exp_avg)
    assert torch.equal(block.exp_avg_sq, before.exp_avg_sq)
    assert [float(s) for s in block.steps] == [float(s) for s in in_place.steps]
    assert torch.equal(out[0], in_place.master) and torch.equal(out[1], in_place.exp_avg)
    assert torch.equal(out[2], in_place.exp_avg_sq)
    if any(keep):
        assert not in_place.same(before)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once (the product of two fp32 values is exact in a double)."""
    return (a.double() * b.double() + c.double()).float()


def _sequence(p, g, m, v, k, fused: str = ""):
    """bf16's sequence on fp32 tensors, each step one rounding, except the multiply-add named by ``fused``
    contracted into one (site and which product: what a compiler's contraction could make of it)."""
    decay, b1, c1, b2, c2, step_size, inv_bias_root, eps = (torch.tensor(c, dtype=torch.float32) for c in k)
    p = p * decay
    m = {"m:first": lambda: _fma(m, b1, g * c1), "m:second": lambda: _fma(g, c1, m * b1)}.get(
        fused, lambda: (m * b1) + (g * c1))()
    gg = g * g
    v = {"v:first": lambda: _fma(v, b2, gg * c2), "v:second": lambda: _fma(gg, c2, v * b2)}.get(
        fused, lambda: (v * b2) + (gg * c2))()
    root = torch.sqrt(v.double()).float()
    d = _fma(root, inv_bias_root, eps) if fused == "d" else (root * inv_bias_root) + eps
    p = _fma(-(m / d), step_size, p) if fused == "p" else p - ((m / d) * step_size)
    return p, m, v


@pytest.mark.parametrize("fused", ["m:first", "m:second", "v:first", "v:second", "d", "p"])
def test_the_contraction_probe_catches_each_fused_multiply_add(fused):
    """On the build check's input, the sequence with any one multiply-add fused gives another master than without:
    a kernel compiled with that contraction fails the check. (Without: the torch-ops path's bits.)"""
    master, grad, m, v, constants = contraction_probe()
    plain = _sequence(master, grad, m.float(), v.float(), constants)
    p, m32, v32 = master.clone(), m.float(), v.float()
    bf16_ops_step(p, grad, m32, v32, constants, torch.empty_like(p), torch.empty_like(p))
    assert torch.equal(plain[0], p) and torch.equal(plain[1], m32) and torch.equal(plain[2], v32)
    assert not torch.equal(_sequence(master, grad, m.float(), v.float(), constants, fused)[0], p)


def test_the_real_build_passes_its_contraction_check(kernel):
    assert kernel.bf16_exact
    assert "compiler" in kernel.describe() and "bf16 bit-identical" in kernel.describe()


def test_a_failed_contraction_check_sends_bf16_to_torch_ops_with_one_warning(kernel, monkeypatch, caplog):
    """A build whose adamw_bf16 differs from the torch-ops path on the probe (here: the check's torch ops made to
    differ by one ulp) warns once, naming the compiler; bf16 updates then run torch ops, int8 keeps the kernel."""
    def off_by_an_ulp(p, *args, **kwargs):
        bf16_ops_step(p, *args, **kwargs)
        p[0] = torch.nextafter(p[0], torch.tensor(float("inf")))

    monkeypatch.setattr(moment_kernel, "bf16_ops_step", off_by_an_ulp)
    with caplog.at_level(logging.WARNING, logger=moment_kernel.__name__):
        mismatched = moment_kernel.Int8Kernel()  # loads the cached build
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "contraction check" in warnings[0].getMessage()
    assert mismatched.compiler() in warnings[0].getMessage()
    assert not mismatched.bf16_exact and "torch ops" in mismatched.describe()

    calls: list[str] = []
    real_int8 = mismatched.update
    monkeypatch.setattr(mismatched, "update_bf16", lambda *a, **k: calls.append("bf16"))
    monkeypatch.setattr(mismatched, "update", lambda *a, **k: calls.append("int8") or real_int8(*a, **k))
    by_kernel = Block("bf16", SIZES, seed=4)
    by_ops = by_kernel.clone()
    by_kernel.update(_grads(1), [True] * len(SIZES), HYPERS, scratch=MomentScratch(int8_kernel=mismatched))
    by_ops.update(_grads(1), [True] * len(SIZES), HYPERS)
    assert by_kernel.same(by_ops) and calls == []
    Block("int8", SIZES).update(_grads(1), [True] * len(SIZES), HYPERS, scratch=MomentScratch(int8_kernel=mismatched))
    assert calls == ["int8"]


def test_the_bf16_kernel_refuses_non_contiguous_inputs(kernel):
    sizes = [64, 64]
    master, grad = torch.zeros(256)[::2], torch.zeros(128)
    m, v = torch.zeros(128, dtype=torch.bfloat16), torch.zeros(128, dtype=torch.bfloat16)
    steps = [torch.ones(()), torch.ones(())]
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.update_bf16(master, grad, m, v, sizes, [True, True], steps, HYPERS[:2], (master, m, v), {})
