"""Which rank owns each block ([Note: block ownership]): every block exactly one owner, the load even within the
largest block, consecutive equal blocks on consecutive ranks, the same answer on every rank."""

from __future__ import annotations

import pytest

from runtime.planning.ownership import assign_owners, imbalance


def test_llama_8b_shape_on_four_ranks_is_balanced_and_interleaved():
    # embedding, 32 layers, final norm + head: the 8B scenario's blocks (parameters, millions)
    numels = [525, *[218] * 32, 525]
    owners = assign_owners(numels, 4)
    assert sorted(set(owners)) == [0, 1, 2, 3]
    assert imbalance(numels, owners, 4) < 1.03
    layers = owners[1:33]
    assert all(a != b for a, b in zip(layers, layers[1:], strict=False))  # the next block's owner is another rank


def test_one_rank_owns_everything_and_the_answer_is_deterministic():
    numels = [5, 3, 3, 9, 1]
    assert assign_owners(numels, 1) == [0] * 5
    assert assign_owners(numels, 3) == assign_owners(list(numels), 3)


def test_more_ranks_than_blocks_leaves_some_ranks_without_state():
    assert sorted(assign_owners([4, 4], 3)) == [0, 1]


def test_a_bad_world_size_is_refused():
    with pytest.raises(ValueError, match="world_size"):
        assign_owners([1], 0)


def test_each_rank_plans_with_its_share_of_the_node_budgets():
    """tiers.host.budget and tiers.nvme.budget are the node's: each rank plans with the part its parameters take."""
    import torch

    from runtime.bundled.example_model import ExampleLM, ModelShape
    from runtime.config.loader import load_config
    from runtime.core.blocks import build_blocks
    from runtime.planning.ownership import owned_blocks, rank_config

    model = ExampleLM(ModelShape(vocab_size=256, hidden_size=32, num_layers=4, num_heads=4, ffn_size=64))
    blocks = build_blocks(model, min_block_nbytes=1 << 30)
    cfg = load_config({"device": "cpu", "tiers": {"host": {"budget": "1GiB"}, "nvme": {"budget": "4GiB"}}})
    total = sum(b.numel for b in blocks)
    shares = []
    for rank in range(3):
        owned = owned_blocks(blocks, rank, 3)
        ours = rank_config(cfg, blocks, owned, torch.device("cpu"))
        share = sum(b.numel for b in owned) / total
        assert ours.tiers.host.budget == int((1 << 30) * share) and ours.tiers.nvme.budget == int((4 << 30) * share)
        assert ours.placement == cfg.placement and ours.optimizer.lr == cfg.optimizer.lr  # the rest is the node's
        shares.append(share)
    assert abs(sum(shares) - 1.0) < 1e-9
    assert torch.tensor(shares).min() > 0
