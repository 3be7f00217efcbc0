"""bf16 moments' stochastic rounding ([Note: bf16 stochastic rounding] in runtime/update/moment_formats.py): the hash
is the documented integer function (checked against Python integers); a value lands on one of its two bf16
neighbours, unbiased; a bf16 v decays under zero gradients as fp32's does (round to nearest holds it); the bits depend
only on (index in the block, step, seed, kind): not on the piece size or the thread count, and a run resumed from its
state rounds as the uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from runtime.update.adam import AdamWHyper
from runtime.update.moment_formats import mix32, round_bf16_stochastic, rounding_bits, rounding_offsets
from runtime.update.moments import QUANT_BLOCK, MomentScratch, adamw_update_block, moment_storage

MASK32 = 0xFFFFFFFF


def python_mix32(x: int) -> int:
    """The hash on Python integers: what mix32 must compute for any 32-bit value."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & MASK32
    return x ^ (x >> 16)


def python_bits(index: int, step: int, seed: int, kind_bit: int) -> int:
    """The random bits of element ``index`` at ``step`` on Python integers, as the Note defines them."""
    salt = python_mix32(step ^ python_mix32((seed << 2) | kind_bit))
    o1, o2 = salt % 65521, python_mix32(salt) % 65519
    return (python_mix32(((index + o1) % 65521) ^ 0x3C6EF372) >> 16) ^ (python_mix32(((index + o2) % 65519) ^ 0x1B873593) >> 16)


def stochastic(values: torch.Tensor, step: int, seed: int = 0, kind: str = "exp_avg_sq", start: int = 0) -> torch.Tensor:
    """``values`` rounded to bf16 as the update's narrowing at ``step`` does for elements ``start..``."""
    out = torch.empty(values.numel(), dtype=torch.bfloat16)
    bits = torch.empty(values.numel(), dtype=torch.int32)
    offsets = rounding_offsets(torch.tensor([float(step)]), seed, kind)[0].tolist()
    rounding_bits(start, (offsets[0], offsets[1]), bits)  # the slicing path, as the CPU update runs it
    round_bf16_stochastic(values, bits, out)
    return out


def test_the_bits_are_the_documented_integer_function():
    samples = [0, 1, 2, 12345, 1 << 31, MASK32 - 1, MASK32]
    assert mix32(torch.tensor(samples, dtype=torch.int64)).tolist() == [python_mix32(x) for x in samples]
    start, numel = 1_000_000, 200_000  # three table lengths and a bit: the slices wrap around both tables
    for step, seed, kind, kind_bit in ((5, 7, "exp_avg_sq", 2), (1 << 20, 0, "exp_avg", 1)):
        offsets = rounding_offsets(torch.tensor([float(step)]), seed, kind)[0]
        sliced, gathered = torch.empty(numel, dtype=torch.int32), torch.empty(numel, dtype=torch.int32)
        rounding_bits(start, (int(offsets[0]), int(offsets[1])), sliced)
        rounding_bits(start, offsets, gathered)
        assert torch.equal(sliced, gathered)
        for i in (0, 1, 65520, 65521, 131041, numel - 1):
            assert int(sliced[i]) == python_bits(start + i, step, seed, kind_bit), (step, i)


def test_a_value_rounds_to_one_of_its_neighbours_without_bias():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(20000, generator=gen) * 10.0 ** torch.randint(-20, 20, (20000,), generator=gen)
    down = values.view(torch.int32).bitwise_and(-(1 << 16)).view(torch.float32)  # towards zero
    up = (values.view(torch.int32).bitwise_and(-(1 << 16)) + (1 << 16)).view(torch.float32)
    total = torch.zeros(values.numel(), dtype=torch.float64)
    rounds = 256
    for step in range(1, rounds + 1):
        rounded = stochastic(values, step).float()
        assert torch.all((rounded == down) | (rounded == up))
        total += rounded.double()
    # The mean of 256 roundings: within 4 standard deviations (ulp / (2 sqrt(256)) at most) of the value.
    error = ((total / rounds - values.double()) / (up - down).double()).abs()
    assert error.max() < 4 * 0.5 / rounds**0.5
    assert error.mean() < 0.05  # round to nearest: 0.25 on average
    exact = down.bfloat16().float()
    assert torch.equal(stochastic(exact, 3).float(), exact)  # bf16 values stay as they are
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])  # torch's NaN: quiet, 0x7FC00000
    rounded = stochastic(special, 3).float()
    assert torch.equal(rounded[:4].view(torch.int32), special[:4].view(torch.int32)) and rounded[4].isnan()


def _decay(stochastic_kinds: tuple[str, ...] | None, monkeypatch) -> torch.Tensor:
    """A bf16 v of ones decayed 300 steps by zero gradients (beta2 0.999) through adamw_update_block (None: the
    kinds it rounds stochastically by default)."""
    if stochastic_kinds is not None:
        monkeypatch.setattr("runtime.update.moments.BF16_STOCHASTIC_KINDS", stochastic_kinds)
    sizes = [4096, 100]
    dtype, numel = moment_storage("bf16", sizes)
    master, grad = torch.zeros(numel), torch.zeros(numel)
    exp_avg, exp_avg_sq = torch.zeros(numel, dtype=dtype), torch.ones(numel, dtype=dtype)
    steps = [torch.zeros(()) for _ in sizes]
    for _ in range(300):
        adamw_update_block(master, grad, exp_avg, exp_avg_sq, sizes, [True, True], steps, [AdamWHyper()] * 2, "bf16")
    return exp_avg_sq.float()


def test_a_bf16_v_decays_as_fp32s_does(monkeypatch):
    """beta2 0.999: each step's 0.1% is under half a bf16 ulp. Round to nearest keeps v at 1 forever; stochastic
    rounding keeps the decay on average (0.999^300 = 0.741)."""
    assert _decay(None, monkeypatch).mean().item() == pytest.approx(0.999**300, rel=0.002)
    assert torch.all(_decay((), monkeypatch) == 1.0)


class Block:
    """A bf16 block's state after some steps of random gradients, each step a fresh call."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        dtype, numel = moment_storage("bf16", sizes)
        self.master = torch.randn(numel, generator=torch.Generator().manual_seed(1))
        self.exp_avg, self.exp_avg_sq = torch.zeros(numel, dtype=dtype), torch.zeros(numel, dtype=dtype)
        self.steps = [torch.zeros(()) for _ in sizes]

    def run(self, first: int, last: int, **kwargs) -> Block:
        for step in range(first, last + 1):
            grad = torch.randn(self.master.numel(), generator=torch.Generator().manual_seed(step)).to(self.master.device)
            keep = [True, step % 2 == 0, True]
            adamw_update_block(self.master, grad, self.exp_avg, self.exp_avg_sq, self.sizes, keep,
                               [s for s, k in zip(self.steps, keep, strict=True) if k],
                               [AdamWHyper(lr=1e-2)] * sum(keep), "bf16", **kwargs)
        return self

    def state(self) -> list[torch.Tensor]:
        return [self.master, self.exp_avg.float(), self.exp_avg_sq.float(), torch.stack(self.steps)]


def _equal(a: Block, b: Block) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state(), b.state(), strict=True))


SIZES = [5 * QUANT_BLOCK + 3, 17, 3 * QUANT_BLOCK]


def test_the_bits_depend_on_neither_piece_size_nor_threads():
    threads = torch.get_num_threads()
    whole = Block(SIZES).run(1, 4)
    small = Block(SIZES).run(1, 4, piece_numel=QUANT_BLOCK, scratch=MomentScratch())
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        other = Block(SIZES).run(1, 4, piece_numel=2 * QUANT_BLOCK)
    finally:
        torch.set_num_threads(threads)
    assert _equal(whole, small) and _equal(whole, other)


def test_a_resumed_run_rounds_as_the_uninterrupted_one():
    """No RNG state: a block rebuilt from another's state at step 2 continues bit for bit."""
    uninterrupted = Block(SIZES).run(1, 5)
    stopped = Block(SIZES).run(1, 2)
    resumed = Block(SIZES)
    resumed.master, resumed.exp_avg, resumed.exp_avg_sq = (t.clone() for t in (stopped.master, stopped.exp_avg,
                                                                                 stopped.exp_avg_sq))
    resumed.steps = [s.clone() for s in stopped.steps]
    assert _equal(resumed.run(3, 5), uninterrupted)


def test_seed_kind_step_and_index_each_change_the_bits():
    values = torch.full((4096,), 1.0 + 2.0**-8)  # halfway between two bf16 values: the bits decide
    base = stochastic(values, 1)
    for other in (stochastic(values, 2), stochastic(values, 1, seed=1), stochastic(values, 1, kind="exp_avg"),
                  stochastic(values, 1, start=1)):
        assert not torch.equal(other, base)
    assert torch.equal(stochastic(values, 1), base)
    assert 0.45 < (base.float() > 1.0).float().mean().item() < 0.55


@pytest.mark.gpu
def test_cuda_rounds_as_the_cpu():
    cuda = torch.device("cuda")
    values = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    offsets = rounding_offsets(torch.tensor([9.0], device=cuda), 3, "exp_avg")[0]  # gathered on the device
    bits = torch.empty(values.numel(), dtype=torch.int32, device=cuda)
    rounding_bits(0, offsets, bits)
    out = torch.empty(values.numel(), dtype=torch.bfloat16, device=cuda)
    round_bf16_stochastic(values.to(cuda), bits, out)
    assert torch.equal(out.cpu(), stochastic(values, 9, seed=3, kind="exp_avg"))
    cpu = Block(SIZES).run(1, 3)
    gpu = Block(SIZES)
    gpu.master, gpu.exp_avg, gpu.exp_avg_sq = (t.to(cuda) for t in (gpu.master, gpu.exp_avg, gpu.exp_avg_sq))
    gpu.steps = [s.to(cuda) for s in gpu.steps]
    gpu.run(1, 3, scratch=MomentScratch(cuda))
    # fused AdamW on CUDA rounds its arithmetic its own way: the moments agree to a bf16 step, most of them exactly
    assert torch.allclose(gpu.exp_avg_sq.float().cpu(), cpu.exp_avg_sq.float(), rtol=2**-7, atol=0)
