"""The memory plan bounds what a run really holds: the store's GPU tier never holds more weights than the plan's
"weights in flight" row, in the usual schedule and in the ones that hold blocks out of order (a tied head
held through the whole backward, activation checkpointing)."""

from __future__ import annotations

import pytest
import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM, ModelShape
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


def test_auto_placement_can_be_asked_again_at_another_reserve():
    """The profiler's advice asks auto placement what it would choose at a lower activation reserve: the session's
    config with that reserve and the store's GPU budget. On the CPU every auto is 0 (the device is the CPU)."""
    from runtime.planning.placement import placement_at_reserve
    from runtime.session import in_force, placement_asker

    model, optimizer = offload(ExampleLM(ModelShape(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                                                    ffn_size=128, max_seq_len=32)), {"dtype": "fp32"})
    with optimizer.session as session:
        placement = placement_at_reserve(session.blocks, session.config, session.store.device, in_force(session), 1 << 30)
        ask = placement_asker(session)
        assert ask(1 << 30) == placement
    assert ask(1 << 30) is None  # a closed session (a profile saved after close()) is asked nothing
    assert (placement.gpu_update_fraction, placement.gpu_stream_fraction, placement.keep_for_backward_nbytes) == (0, 0, 0)
    assert any("the device is the CPU" in note for note in placement.notes)


@pytest.mark.gpu
def test_a_lower_reserve_puts_no_fewer_blocks_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA; run on the GPU machine")
    from runtime.planning.auto_placement import gpu_updated_blocks
    from runtime.session import placement_asker

    model, optimizer = offload(ExampleLM(ModelShape(vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=8,
                                                    ffn_size=2816)), {"dtype": "bf16", "tiers": {"gpu": {"budget": "3GiB"}}})
    with optimizer.session as session:
        ask = placement_asker(session)
        counts = [len(gpu_updated_blocks(session.blocks, ask(reserve << 20).gpu_update_fraction))
                  for reserve in (2048, 1024, 256)]
        assert counts == sorted(counts) and counts[-1] > len(session.controller.gpu_updated), counts
