"""HostGradSums on its own (runtime.engine.host_sums): sums in micro-batch order piece by piece, reports which parameters
got a gradient, starts afresh after finish / reset, and surfaces a failed sum."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from runtime.core.blocks import build_blocks
from runtime.engine.host_sums import HostGradSums
from tierstore import StoreConfig, TensorMeta, TierName, TierStore


@pytest.fixture
def setup():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    blocks = build_blocks(model, 1)
    store = TierStore(StoreConfig(device="cpu", pin=False))
    for block in blocks:
        store.register(block.key("grad"), TensorMeta(torch.float32, block.numel), TierName.HOST)
    sums = HostGradSums(store, blocks, slots=2)
    sums.piece_numel = 16  # blocks of 72 and 27 elements travel in several pieces (buffers hold 72)
    yield blocks, store, sums
    sums.close()
    store.close()


def host_sum(store: TierStore, block) -> torch.Tensor:
    return store.tensor(block.key("grad"), TierName.HOST)


def test_sums_run_in_micro_batch_order_piece_by_piece(setup):
    blocks, store, sums = setup
    block = blocks[0]
    grads = [torch.randn(block.numel) for _ in range(3)]
    for grad in grads:
        sums.add(block, grad, [True] * len(block.slots))
    assert sums.finish(block.index) == [True] * len(block.slots)
    assert torch.equal(host_sum(store, block), (grads[0] + grads[1]) + grads[2])
    assert sums.stats.nbytes == 3 * block.numel * 4


def test_bf16_sums_add_in_bf16_in_micro_batch_order_as_a_bf16_grad_does():
    """``host_grad_dtype: compute`` under bf16: each add rounds to bf16, in micro-batch order, as plain PyTorch's
    ``.grad`` of a bf16 parameter accumulates (not the fp32 sum rounded once), and half the bytes cross."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    blocks = build_blocks(model, 1)
    block = blocks[0]
    with TierStore(StoreConfig(device="cpu", pin=False)) as store:
        store.register(block.key("grad"), TensorMeta(torch.bfloat16, block.numel), TierName.HOST)
        sums = HostGradSums(store, [block], dtype=torch.bfloat16, slots=2)
        sums.piece_numel = 16
        try:
            grads = [torch.randn(block.numel, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(4)]
            plain = torch.zeros(block.numel, dtype=torch.bfloat16)
            for grad in grads:
                sums.add(block, grad, [True] * len(block.slots))
                plain += grad  # what AccumulateGrad does to a bf16 .grad
            sums.finish(block.index)
            assert torch.equal(host_sum(store, block), plain)
            assert not torch.equal(plain, torch.stack([g.float() for g in grads]).sum(0).bfloat16())  # it rounds
            assert sums.stats.nbytes == 4 * block.numel * 2
        finally:
            sums.close()


def test_a_gradient_other_than_the_block_s_flat_one_of_the_sums_dtype_is_refused(setup):
    blocks, store, sums = setup
    with pytest.raises(ValueError, match="flat float32 gradient, got bfloat16"):
        sums.add(blocks[0], torch.zeros(blocks[0].numel, dtype=torch.bfloat16), [True] * len(blocks[0].slots))
    sums.close()
    narrow = HostGradSums(store, blocks, dtype=torch.bfloat16, slots=2)
    try:
        with pytest.raises(ValueError, match="flat bfloat16 gradient, got float32"):
            narrow.add(blocks[0], torch.zeros(blocks[0].numel), [True] * len(blocks[0].slots))
    finally:
        narrow.close()


def test_parameters_with_a_gradient_in_any_micro_batch_are_reported(setup):
    blocks, _, sums = setup
    block = blocks[0]
    assert len(block.slots) == 2
    sums.add(block, torch.zeros(block.numel), [True, False])
    sums.add(block, torch.zeros(block.numel), [False, False])
    assert sums.finish(block.index) == [True, False]
    assert sums.finish(block.index) is None  # nothing sent since: the next step starts afresh


def test_after_finish_or_reset_the_next_micro_batch_starts_the_sum(setup):
    blocks, store, sums = setup
    block = blocks[1]
    ones = torch.ones(block.numel)
    sums.add(block, ones, [True] * len(block.slots))
    sums.reset()  # a dropped step
    sums.add(block, 2 * ones, [True] * len(block.slots))
    sums.finish(block.index)
    assert torch.equal(host_sum(store, block), 2 * ones)


def test_the_backward_waits_for_a_free_staging_buffer(setup, monkeypatch):
    blocks, _, sums = setup
    sums.piece_numel = blocks[0].numel  # one piece a micro-batch
    release = threading.Event()
    original = sums._sum
    monkeypatch.setattr(sums, "_sum", lambda pending: (release.wait(5), original(pending)))
    block = blocks[0]
    sums.add(block, torch.ones(block.numel), [True] * len(block.slots))
    sums.add(block, torch.ones(block.numel), [True] * len(block.slots))  # both slots taken now
    third = threading.Thread(target=sums.add, args=(block, torch.ones(block.numel), [True] * len(block.slots)))
    third.start()
    third.join(0.2)
    assert third.is_alive()  # no slot free until a sum lands
    release.set()
    third.join(5)
    assert not third.is_alive()
    sums.finish(block.index)
    assert sums.stats.staging_wait_s >= 0.1


def test_a_failed_sum_raises_at_finish_and_at_the_next_add(setup, monkeypatch):
    blocks, _, sums = setup

    def fail(pending):
        raise OSError("planted")

    monkeypatch.setattr(sums, "_sum", fail)
    block = blocks[0]
    sums.piece_numel = block.numel  # one piece: the add returns before the sum fails
    sums.add(block, torch.ones(block.numel), [True] * len(block.slots))
    with pytest.raises(RuntimeError, match="summing gradients on the host failed.*planted"):
        sums.finish(block.index)
    with pytest.raises(RuntimeError, match="planted"):
        sums.add(block, torch.ones(block.numel), [True] * len(block.slots))


def test_close_is_idempotent_and_returns_the_staging_buffers(setup):
    _, store, sums = setup
    used = store.usage()["host"]["used_nbytes"]
    sums.close()
    sums.close()
    assert store.usage()["host"]["used_nbytes"] < used


def test_pieces_made_on_demand_are_summed_like_a_whole_gradient(setup):
    """add_pieces asks for each piece once a staging buffer is free for it, in order, and sums what it gets as
    add would the whole gradient; a piece of the wrong size or dtype is refused and its buffer given back."""
    blocks, store, sums = setup
    block = blocks[0]
    grads = [torch.randn(block.numel) for _ in range(2)]
    asked: list[tuple[int, int]] = []

    def piece_of(grad: torch.Tensor):
        def piece(begin: int, end: int) -> torch.Tensor:
            asked.append((begin, end))
            return grad[begin:end].clone()
        return piece

    for grad in grads:
        sums.add_pieces(block, piece_of(grad), [True] * len(block.slots))
    assert asked[:5] == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 72)] and len(asked) == 10
    sums.finish(block.index)
    assert torch.equal(host_sum(store, block), grads[0] + grads[1])
    sums.reset()
    with pytest.raises(ValueError, match=r"piece \[0, 16\).*16 float32 elements, got bfloat16"):
        sums.add_pieces(block, lambda begin, end: torch.zeros(end - begin, dtype=torch.bfloat16), [True] * len(block.slots))
    assert sorted(sums._free) == [0, 1]  # the refused piece's buffer is free again
