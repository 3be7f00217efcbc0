"""The memory plan bounds what a run really holds: the store's GPU tier never holds more weights than the plan's
"weights in flight" row, in the usual schedule and in the ones that hold blocks out of order (a tied head
held through the whole backward, activation checkpointing)."""

from __future__ import annotations

import pytest
import torch

from runtime import offload
from runtime.example_model import ExampleLM, ModelShape
from tierstore import TierName


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_gpu_tier_holds_no_more_weights_than_the_plan_counts(tie, checkpointing):
    torch.manual_seed(0)
    shape = ModelShape(vocab_size=16384, hidden_size=256, num_layers=8, num_heads=4, ffn_size=688, max_seq_len=64,
                       tie_embeddings=tie)  # the embedding (and head) four times a layer: a 128k vocabulary's shape
    model, optimizer = offload(ExampleLM(shape, activation_checkpointing=checkpointing), {
        "dtype": "fp32", "optimizer": {"grad_clip": None},
        "prefetch": {"depth": 2, "keep_for_backward": 0}, "tiers": {"gpu": {"budget": "1GiB"}}})
    session = optimizer.session
    tier = session.store.tiers[TierName.GPU]
    peak = 0
    reserve = tier.reserve

    def reserve_and_watch(*args, **kwargs):
        nonlocal peak
        result = reserve(*args, **kwargs)
        peak = max(peak, tier.used_nbytes)
        return result

    tier.reserve = reserve_and_watch
    with session:
        for _ in range(3):
            tokens = torch.randint(0, shape.vocab_size, (2, 32))
            model(tokens, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
    row = next(n for kind, tier_name, n in session.plan.rows if kind.startswith("weights (") and tier_name == "gpu")
    largest = max(b.numel for b in session.blocks) * 4
    assert largest < peak <= row  # the bytes moved through the tier, and stayed within the plan
    if tie:  # the tied embedding's block is held through the backward beside three layers far from it:
        assert peak == row  # the bound is tight there
