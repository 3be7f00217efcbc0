"""A quick quality check of compact moments on the CPU: a 3-layer MLP fitting a noisy teacher, trained 200 steps
through adamw_update_block from the same init and batches with each moment_dtype. The held-out loss of bf16 is
within 1% of fp32's and of int8 within 3% (measured: bf16 within 0.15%, int8 within 0.8%). The real quality run,
on text with a Llama-shaped model, is on the GPU machine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from runtime.update.adam import AdamWHyper, split_views
from runtime.update.moments import MOMENT_DTYPES, MomentScratch, adamw_update_block, moment_storage, zero_moments

STEPS = 200
NOISE = 0.05  # the teacher's targets carry noise: the loss floor is NOISE^2, the models stay above it


class FlatAdamW:
    """A model's parameters made views of one flat fp32 master, updated by adamw_update_block with moments stored
    in moment_dtype (what the offload runtime does for one block)."""

    def __init__(self, model: nn.Module, moment_dtype: str, lr: float, scratch: MomentScratch | None = None):
        self.params = list(model.parameters())
        self.sizes = [p.numel() for p in self.params]
        self.master = torch.cat([p.detach().flatten() for p in self.params])
        for p, view in zip(self.params, split_views(self.master, self.sizes), strict=True):
            p.data = view.view_as(p)  # the update writes master; the model sees it
        dtype, numel = moment_storage(moment_dtype, self.sizes)
        self.exp_avg, self.exp_avg_sq = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        zero_moments(self.exp_avg, moment_dtype, self.sizes)
        zero_moments(self.exp_avg_sq, moment_dtype, self.sizes)
        self.steps = [torch.zeros(()) for _ in self.sizes]
        self.hypers = [AdamWHyper(lr=lr, weight_decay=0.01)] * len(self.sizes)
        self.moment_dtype = moment_dtype
        self.scratch = scratch

    def step(self) -> None:
        """One update from the parameters' gradients."""
        grad = torch.cat([p.grad.flatten() for p in self.params])  # type: ignore[union-attr]
        adamw_update_block(self.master, grad, self.exp_avg, self.exp_avg_sq, self.sizes, [True] * len(self.sizes),
                           self.steps, self.hypers, self.moment_dtype, scratch=self.scratch)


def _train(moment_dtype: str, seed: int, lr: float, scratch: MomentScratch | None = None) -> tuple[float, float]:
    """(first training loss, final held-out loss) of the student trained with moment_dtype."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(7)
    teacher = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 8))
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    optimizer = FlatAdamW(model, moment_dtype, lr, scratch)
    held_x = torch.randn(4096, 32, generator=gen)
    with torch.no_grad():
        held_y = teacher(held_x) + NOISE * torch.randn(4096, 8, generator=gen)
    first = None
    for _ in range(STEPS):
        x = torch.randn(128, 32, generator=gen)
        with torch.no_grad():
            y = teacher(x) + NOISE * torch.randn(128, 8, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        first = loss.item() if first is None else first
        optimizer.step()
    with torch.no_grad():
        return first, nn.functional.mse_loss(model(held_x), held_y).item()  # type: ignore[return-value]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Small tensors: on a busy machine, torch's threads only wait on each other (14 s instead of 1 s on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("seed,lr", [(0, 3e-3), (1, 1e-3)])
def test_compact_moments_train_as_well_as_fp32(seed, lr):
    results = {moment_dtype: _train(moment_dtype, seed, lr) for moment_dtype in MOMENT_DTYPES}
    first, fp32 = results["fp32"]
    assert fp32 < first / 10  # it trained, and is still above the floor: the optimizer's precision shows
    assert fp32 > NOISE**2
    assert results["bf16"][1] == pytest.approx(fp32, rel=0.01)
    assert results["int8"][1] == pytest.approx(fp32, rel=0.03)


def _train_lm(moment_dtype: str, lr: float, steps: int = STEPS) -> float:
    """Held-out loss of the bundled ExampleLM (tiny preset, byte tokens) after ``steps`` steps on the stdlib corpus."""
    from runtime.bundled.data import ByteBatches, stdlib_text_bytes
    from runtime.bundled.example_model import PRESETS, ExampleLM

    corpus = stdlib_text_bytes(4 << 20)
    torch.manual_seed(0)
    model = ExampleLM(PRESETS["tiny"])
    optimizer = FlatAdamW(model, moment_dtype, lr)
    batches = ByteBatches(corpus, 16, 128, seed=1)
    held_batches = ByteBatches(corpus, 64, 128, seed=2)
    held = [held_batches.next() for _ in range(4)]
    for _ in range(steps):
        loss = model(*batches.next())
        model.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return sum(model(*batch).item() for batch in held) / len(held)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_compact_moments_train_the_bundled_lm():
    """The tiny ExampleLM, byte tokens (rare bytes' embedding rows get tiny v beside common ones: the int8 map's
    corner), lr 3e-3. Measured (torch 2.13, CPU): bf16 +0.07% (its v by stochastic rounding; with v rounded to
    nearest +0.97%: it cannot record v's 0.1% decay a step, below half a bf16 ulp, so v stays high), int8 +0.02%.
    The rounding seed moves bf16 by about 0.2-0.3% either way; the bound keeps that margin below the 1% goal. At
    1,000 steps (2026-11-28, no longer run here: CI's time): bf16 +0.31%, int8 +0.16%; 1,000 steps of a 504M Llama on
    real text are measured on the GPU machine (docs/benchmarks.md: bf16 0.998x, int8 1.003x)."""
    fp32 = _train_lm("fp32", 3e-3)
    assert fp32 < 2.2  # from ln(256) = 5.5: it trained
    assert _train_lm("bf16", 3e-3) == pytest.approx(fp32, rel=0.005)
    assert _train_lm("int8", 3e-3) == pytest.approx(fp32, rel=0.02)
