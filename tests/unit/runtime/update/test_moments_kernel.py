"""The compiled int8 kernel (opt-in, built with torch's cpp_extension): one step from the same state lands where the
torch-ops path lands (codes within one, scales and master to fp32 rounding), skipped parameters keep every byte,
out= leaves the inputs, and it trains as well; the kernel's updates (int8 and bf16) run without the GIL. (The bf16
update's bit equality: test_moments_kernel_bf16.) Slow: the first build takes a minute (cached after)."""

from __future__ import annotations

import pytest
import torch

from runtime.update.adam import AdamWHyper
from runtime.update.moment_formats import int8_layout, int8_views
from runtime.update.moments import Int8Kernel, MomentScratch, adamw_update_block, encode_moment, moment_storage

pytestmark = pytest.mark.slow

SIZES = [3000, 70001, 17, 1 << 14, 5, 4096, 0]
HYPERS = [AdamWHyper(lr=1e-2), AdamWHyper(lr=1e-2), AdamWHyper(lr=3e-3, weight_decay=0.0), AdamWHyper(lr=1e-2),
          AdamWHyper(lr=1e-2, eps=1e-6), AdamWHyper(lr=1e-2, beta1=0.8, beta2=0.95), AdamWHyper()]


@pytest.fixture(scope="module")
def kernel() -> Int8Kernel:
    built = Int8Kernel.build()
    assert built is not None, "the int8 kernel did not build (see the log): a C++ compiler is needed"
    return built


def _state(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(SIZES)
    master = torch.randn(total, generator=gen)
    dtype, numel = moment_storage("int8", SIZES)
    exp_avg, exp_avg_sq = torch.zeros(numel, dtype=dtype), torch.zeros(numel, dtype=dtype)  # the tail too
    encode_moment(torch.randn(total, generator=gen) * 1e-2, "int8", "exp_avg", SIZES, exp_avg)
    wide = torch.exp(torch.empty(total).uniform_(-40, 0, generator=gen))  # many decades of v in one block
    encode_moment(wide, "int8", "exp_avg_sq", SIZES, exp_avg_sq)
    return master, exp_avg, exp_avg_sq


def _step(state, keep, scratch, out=None):
    master, exp_avg, exp_avg_sq = state
    grad = torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(9))
    steps = [torch.full((), 4.0) for k in keep if k]
    hypers = [h for h, k in zip(HYPERS, keep, strict=True) if k]
    adamw_update_block(master, grad, exp_avg, exp_avg_sq, SIZES, keep, steps, hypers, "int8", scratch=scratch, out=out)
    return steps


@pytest.mark.parametrize("keep", [[True] * 7, [True, False, True, True, False, True, True]])
def test_one_step_lands_where_the_torch_ops_path_lands(kernel, keep):
    codes_nbytes, num_blocks, _ = int8_layout(SIZES)
    by_ops, by_kernel = _state(0), _state(0)
    before = tuple(t.clone() for t in by_kernel)
    steps_ops = _step(by_ops, keep, MomentScratch())
    steps_kernel = _step(by_kernel, keep, MomentScratch(int8_kernel=kernel))
    assert [float(s) for s in steps_ops] == [float(s) for s in steps_kernel] == [5.0] * sum(keep)
    assert torch.allclose(by_kernel[0], by_ops[0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(by_kernel[0], before[0])
    for stored_kernel, stored_ops, signed in ((by_kernel[1], by_ops[1], True), (by_kernel[2], by_ops[2], False)):
        (codes_k, scales_k), (codes_o, scales_o) = int8_views(stored_kernel, SIZES), int8_views(stored_ops, SIZES)
        as_int = (lambda c: c.view(torch.int8).int()) if signed else (lambda c: c.int())
        assert (as_int(codes_k) - as_int(codes_o)).abs().max() <= 1
        assert torch.allclose(scales_k, scales_o, rtol=1e-5, atol=0)
    start = 0
    for size, k, index in zip(SIZES, keep, range(len(SIZES)), strict=True):  # skipped parameters: every byte kept
        if not k:
            assert torch.equal(by_kernel[0][start : start + size], before[0][start : start + size]), index
        start += size
    assert torch.equal(by_kernel[1][codes_nbytes + 4 * num_blocks :], before[1][codes_nbytes + 4 * num_blocks :])
    skipped_codes = slice(4096, 4096 + 71680)  # parameter 1's codes
    if not keep[1]:
        assert torch.equal(by_kernel[1][skipped_codes], before[1][skipped_codes])
        assert torch.equal(by_kernel[2][skipped_codes], before[2][skipped_codes])
    assert not by_kernel[1][3000:4096].any() and not by_kernel[2][3000:4096].any()  # padding codes stay zero


def test_out_of_place_leaves_the_inputs(kernel):
    keep = [True, False, True, True, True, True, True]
    in_place, source = _state(1), _state(1)
    before = tuple(t.clone() for t in source)
    scratch = MomentScratch(int8_kernel=kernel)
    _step(in_place, keep, scratch)
    out = tuple(torch.full_like(t, 3) for t in source)
    _step(source, keep, scratch, out=out)
    assert all(torch.equal(a, b) for a, b in zip(source, before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(out, in_place, strict=True))


def test_it_trains_as_well_as_fp32(kernel):
    from tests.unit.runtime.update.test_moments_quality import _train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors (as the quality test)
    try:
        first, fp32 = _train("fp32", 0, 3e-3)
        _, int8 = _train("int8", 0, 3e-3, scratch=MomentScratch(int8_kernel=kernel))
    finally:
        torch.set_num_threads(threads)
    assert int8 == pytest.approx(fp32, rel=0.03) and fp32 < first / 10


@pytest.mark.parametrize("moment_dtype", ["int8", "bf16"])
def test_the_kernel_runs_without_the_gil(kernel, moment_dtype):
    """The worker thread's update must not stop the training thread's Python: while the kernel runs on another
    thread, this one keeps running (holding the GIL, this thread would stop for the whole call)."""
    import sys
    import threading
    import time

    numel = 1 << 25
    master, grad = torch.randn(numel), torch.randn(numel)
    dtype, stored_numel = moment_storage(moment_dtype, [numel])
    exp_avg, exp_avg_sq = torch.zeros(stored_numel, dtype=dtype), torch.zeros(stored_numel, dtype=dtype)
    scratch = MomentScratch(int8_kernel=kernel)
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(1)  # the kernel takes one core, this thread the other
    sys.setswitchinterval(1e-4)  # hand-overs of the GIL (the worker's Python around the call) take no longer

    def update() -> float:
        start = time.perf_counter()
        adamw_update_block(master, grad, exp_avg, exp_avg_sq, [numel], [True], [torch.zeros(())], [AdamWHyper()],
                           moment_dtype, scratch=scratch)
        return time.perf_counter() - start

    try:
        alone_s = min(update() for _ in range(2))
        worker = threading.Thread(target=update)
        worker.start()
        last, longest_gap_s = time.perf_counter(), 0.0
        while worker.is_alive():
            now = time.perf_counter()
            longest_gap_s, last = max(longest_gap_s, now - last), now
        worker.join()
    finally:
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)
    assert alone_s > 0.01 and longest_gap_s < 0.5 * alone_s, f"this thread stopped {longest_gap_s * 1e3:.1f} ms " \
        f"of a {alone_s * 1e3:.1f} ms update"


def test_the_bench_has_the_kernel_row(kernel, capsys):
    from runtime.bench.adam_bench import main

    assert main(["--numel", "200000", "--threads", "1", "--repeat", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:-1]]
    assert lines[-1].startswith("compiled kernel: int8 encode: ")  # which instructions the build took
    assert [row[0] for row in rows] == ["fp32", "bf16", "int8", "bf16", "int8"]
    assert rows[3][1] == rows[4][1] == "kernel"
    assert rows[3][2] == rows[1][1] and rows[4][2] == rows[2][1]  # the same bytes a parameter


@pytest.mark.parametrize("path", ["torch ops", "kernel"])
def test_a_block_holding_an_infinity_decodes_to_nan(kernel, path):
    """A gradient whose square overflows makes one v infinite: its whole block decodes to NaN on the
    next read (a NaN scale), as fp32 moments would carry it, not to infinities that AdamW turns into frozen steps;
    the other blocks stay finite. An infinite m does the same to its block."""
    from runtime.update.moments import decode_moment

    keep = [True] * len(SIZES)
    master, exp_avg, exp_avg_sq = _state(0)
    grad = torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(9)) * 1e-2
    grad[3000 + 5] = 1e30  # the second parameter's first block: v = inf (its square overflows), m finite
    grad[3000 + 70001 + 17 + 100] = float("inf")  # the fourth's first block: m = inf, v = inf
    steps = [torch.full((), 4.0) for _ in SIZES]
    scratch = MomentScratch(int8_kernel=kernel if path == "kernel" else None)
    adamw_update_block(master, grad, exp_avg, exp_avg_sq, SIZES, keep, steps, HYPERS, "int8", scratch=scratch)
    m, v = decode_moment(exp_avg, "int8", "exp_avg", SIZES), decode_moment(exp_avg_sq, "int8", "exp_avg_sq", SIZES)
    second, fourth = slice(3000, 3000 + 2048), slice(3000 + 70001 + 17, 3000 + 70001 + 17 + 2048)
    assert v[second].isnan().all() and m[second].isfinite().all()
    assert v[fourth].isnan().all() and m[fourth].isnan().all()
    rest = torch.ones(v.numel(), dtype=torch.bool)
    rest[second] = rest[fourth] = False
    assert v[rest].isfinite().all() and m[rest].isfinite().all()
