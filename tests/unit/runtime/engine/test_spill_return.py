"""Spilled moments brought back into pinned memory (runtime.engine.spill_return): room by ranges, not by bytes; the staging
room of the blocks left on NVMe kept placeable; values intact; a read that fails leaves the block spilled."""

from __future__ import annotations

import logging

import torch
from torch import nn

from runtime.core.blocks import Block, ParamSlot
from runtime.engine.spill_return import bring_moments_home
from tierstore import StoreConfig, TensorMeta, TierName, TierStore

UNIT = 4096  # the arena's alignment
MOMENT_NUMEL = 2 * UNIT // 4  # a moment takes two units


def _block(index: int) -> Block:
    param = nn.Parameter(torch.empty(0))
    return Block(index, f"layer{index}", [ParamSlot(f"layer{index}.w", param, 0, MOMENT_NUMEL, torch.Size([MOMENT_NUMEL]), 0)])


def _spilled_store(nvme_dir, holes: int) -> tuple[TierStore, list[Block]]:
    """Two blocks whose moments live on NVMe, and an arena whose free room is ``holes`` ranges of three units each
    (between one-unit keys that stay): by bytes, four moments fit in three such ranges; by ranges, three."""
    store = TierStore(StoreConfig(device="cpu", host_budget_nbytes=15 * UNIT, nvme_path=str(nvme_dir)))
    blocks = [_block(0), _block(1)]
    for block in blocks:
        for kind in ("exp_avg", "exp_avg_sq"):
            value = torch.full((MOMENT_NUMEL,), float(block.index) + (0.5 if kind == "exp_avg_sq" else 0.0))
            store.register(block.key(kind), TensorMeta(torch.float32, MOMENT_NUMEL), TierName.NVME, init=value)
    for position in range(7):  # [3 1 3 1 3 1 3] units
        units = 3 if position % 2 == 0 else 1
        store.register(f"filler{position}", TensorMeta(torch.uint8, units * UNIT), TierName.HOST)
    for position in range(0, 2 * holes, 2):
        store.unregister(f"filler{position}")
    return store, blocks


def _homes(store: TierStore, blocks: list[Block]) -> list[set[TierName]]:
    return [{store.record(b.key(kind)).home for kind in ("exp_avg", "exp_avg_sq")} for b in blocks]


def test_room_by_bytes_is_not_room_by_ranges(tmpfs_dir):
    """Three free ranges of three units: the first block's moments and the second's staging room are four moments,
    eight units of the nine free, but only three fit the ranges: nothing comes back, both stay on NVMe."""
    store, blocks = _spilled_store(tmpfs_dir, holes=3)
    with store:
        assert store.tiers[TierName.HOST].capacity_nbytes - store.tiers[TierName.HOST].used_nbytes == 9 * UNIT
        assert bring_moments_home(store, blocks, [0, 1], frozenset()) == {0, 1}
        assert _homes(store, blocks) == [{TierName.NVME}, {TierName.NVME}]


def test_blocks_come_back_while_the_staging_room_of_those_left_still_fits(tmpfs_dir):
    """Four ranges: the first block comes back beside the second's staging room, then the second (nothing is left to
    stage); their values are the ones on disk. With the second staying on NVMe, the first comes back beside its
    staging room, which stays placeable; with a third staying, two asked back would leave too little for the
    staging room of the others, and neither comes."""
    store, blocks = _spilled_store(tmpfs_dir, holes=4)
    with store:
        assert bring_moments_home(store, blocks, [0, 1], frozenset()) == frozenset()
        assert _homes(store, blocks) == [{TierName.HOST}, {TierName.HOST}]
        for block in blocks:
            assert torch.equal(store.tensor(block.key("exp_avg"), TierName.HOST),
                               torch.full((MOMENT_NUMEL,), float(block.index)))
            assert torch.equal(store.tensor(block.key("exp_avg_sq"), TierName.HOST),
                               torch.full((MOMENT_NUMEL,), float(block.index) + 0.5))
    (tmpfs_dir / "again").mkdir()
    store, blocks = _spilled_store(tmpfs_dir / "again", holes=4)
    with store:
        assert bring_moments_home(store, blocks, [0], frozenset({1})) == {1}
        assert _homes(store, blocks) == [{TierName.HOST}, {TierName.NVME}]
        moment = MOMENT_NUMEL * 4
        arena = store.tiers[TierName.HOST].arena
        assert arena.could_place([moment] * 2) and not arena.could_place([moment] * 3)  # block 1's staging room
    (tmpfs_dir / "third").mkdir()
    store, blocks = _spilled_store(tmpfs_dir / "third", holes=4)
    with store:
        staying = _block(2)
        for kind in ("exp_avg", "exp_avg_sq"):
            store.register(staying.key(kind), TensorMeta(torch.float32, MOMENT_NUMEL), TierName.NVME)
        assert bring_moments_home(store, [*blocks, staying], [0, 1], frozenset({2})) == {0, 1, 2}
        assert _homes(store, blocks) == [{TierName.NVME}, {TierName.NVME}]


def test_a_block_whose_second_moment_cannot_be_read_stays_spilled(tmpfs_dir, monkeypatch, caplog):
    """The second moment's read fails: the first goes back to NVMe, the block stays spilled, nothing raises."""
    store, blocks = _spilled_store(tmpfs_dir, holes=4)
    real = store.move_home

    def failing(key, to):
        if str(key) == blocks[0].key("exp_avg_sq") and TierName(to) is TierName.HOST:
            raise OSError(5, "Input/output error (test)")
        return real(key, to)

    monkeypatch.setattr(store, "move_home", failing)
    caplog.set_level(logging.WARNING, logger="runtime.engine.spill_return")
    with store:
        assert bring_moments_home(store, blocks, [0, 1], frozenset()) == {0, 1}  # stops at the first failure
        assert _homes(store, blocks) == [{TierName.NVME}, {TierName.NVME}]
        assert "moments stay where they were" in caplog.text
        # the moment that had moved is back on NVMe with its value
        assert torch.equal(_read(store, blocks[0].key("exp_avg")), torch.full((MOMENT_NUMEL,), 0.0))


def _read(store: TierStore, key: str) -> torch.Tensor:
    """A key's value wherever it lives (fetched to host from NVMe)."""
    store.fetch(key, TierName.HOST).wait()
    return store.tensor(key, TierName.HOST).clone()
