"""Gradient accumulation summed in host memory (``optimizer.accumulate_on: host``) equals a plain loop's, bit for
bit in fp32 on the CPU: without clipping, with a clip coefficient below 1 and of exactly 1 (early updates), with
activation checkpointing, tied embeddings and fp16 overflow steps. The gradients of the micro-batches that do not
end a step really leave the device (bytes counted) and the parameters hold no gradient between micro-batches."""

from __future__ import annotations

import pytest
import torch

from runtime import offload
from runtime.example_model import ExampleLM, ModelShape
from tests.integration.reference_loop import ReferenceTrainer
from tests.integration.test_parity import SHAPE, assert_identical, make_batches

STEPS = 3


def train_both(config: dict, accumulation: int, *, shape: ModelShape = SHAPE, checkpointing: bool = False,
               dtype: torch.dtype = torch.float32, loss_scale: float | None = None, steps: int = STEPS):
    torch.manual_seed(0)
    model = ExampleLM(shape, activation_checkpointing=checkpointing)
    opt = config.setdefault("optimizer", {})
    opt.update(accumulation_steps=accumulation, accumulate_on="host")
    opt.setdefault("grad_clip", None)
    reference = ReferenceTrainer(model, dtype=dtype, grad_clip=opt["grad_clip"], accumulation_steps=accumulation,
                                 loss_scale=loss_scale)
    model, optimizer = offload(model, config)
    session = optimizer.session
    sums = session.controller.sums
    assert sums is not None, "accumulate_on: host did not give the session host sums"
    batches = make_batches(steps * accumulation)
    ours, theirs = [], []
    with session:
        for step in range(steps):
            micro = batches[step * accumulation : (step + 1) * accumulation]
            for position, (x, y) in enumerate(micro):
                loss = model(x, y)
                ours.append(loss.item())
                optimizer.scale_loss(loss).backward()
                if position < accumulation - 1:  # the device keeps nothing between micro-batches
                    assert all(p.grad is None for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad()
            theirs += reference.train_step(micro)
        weights = session.master_state_dict()
        stats = session.controller.stats
    hosted = sum(block.numel for block in session.blocks)
    assert sums.stats.nbytes == steps * (accumulation - 1) * hosted * 4  # every non-final gradient left, as fp32
    return ours, theirs, weights, reference, stats


@pytest.mark.parametrize("accumulation", [2, 3])
def test_host_sums_equal_the_plain_loop(accumulation):
    ours, theirs, weights, reference, _ = train_both({"dtype": "fp32"}, accumulation)
    assert ours == theirs
    assert_identical(weights, reference)


def test_host_sums_with_a_clip_below_one_and_checkpointing():
    ours, theirs, weights, reference, stats = train_both({"dtype": "fp32", "optimizer": {"grad_clip": 0.05}}, 2,
                                                         checkpointing=True)
    assert ours == theirs
    assert_identical(weights, reference)
    assert min(stats.grad_norms) > 0.05  # every step clipped


def test_host_sums_with_a_clip_that_keeps_early_updates():
    ours, theirs, weights, reference, stats = train_both({"dtype": "fp32", "optimizer": {"grad_clip": 1e6}}, 2)
    assert ours == theirs
    assert_identical(weights, reference)
    assert stats.early_updates > 0  # the last micro-batch's updates ran before the commit and were kept


def test_host_sums_with_tied_embeddings():
    shape = ModelShape(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, tie_embeddings=True)
    ours, theirs, weights, reference, _ = train_both({"dtype": "fp32"}, 2, shape=shape)
    assert ours == theirs
    assert_identical(weights, reference)


def test_host_sums_of_fp16_gradients_skip_overflow_steps_like_the_reference():
    # 2**18 overflows the first three steps' fp16 gradients; the last three update. The reference sums its
    # micro-batches' fp16 gradients in fp16 (its .grad), the host in fp32, so the updated weights agree to the
    # fp16 sum's rounding, not bit for bit; every loss before the first update is equal.
    config = {"dtype": "fp16", "optimizer": {"grad_clip": 1.0, "loss_scale": {"initial": 2.0**18}}}
    ours, theirs, weights, reference, stats = train_both(config, 2, dtype=torch.float16, loss_scale=2.0**18, steps=6)
    assert 1 <= reference.skipped < 6 and stats.skipped_steps == reference.skipped
    before_update = 2 * (reference.skipped + 1)
    assert ours[:before_update] == theirs[:before_update]
    expected = reference.master_state()
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name], rtol=0, atol=1e-4)
