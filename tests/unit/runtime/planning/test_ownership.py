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
