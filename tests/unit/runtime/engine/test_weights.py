"""WeightManager on the CPU stand-in device: parameters are views of one flat buffer per block, holding
0 bytes until fetched; fetched values are the host master cast to the compute dtype; the GPU tier's
accounting follows fetch / release; release is refused while in use and for resident blocks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from runtime.core.blocks import Block, build_blocks
from runtime.engine.weights import WeightManager
from runtime.planning.memory_plan import WeightSource
from tierstore import CapacityError, StoreConfig, TensorMeta, TierName, TierStore

F32 = torch.float32


class Layer(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.lin = nn.Linear(size, size)
        self.norm = nn.LayerNorm(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


class Tiny(nn.Module):
    """rest.before (inp), three layer blocks, rest.after (out): five blocks of odd sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.layers = nn.ModuleList(Layer(7) for _ in range(3))
        self.out = nn.Linear(7, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


@dataclass
class Setup:
    model: Tiny
    blocks: list[Block]
    store: TierStore
    weights: WeightManager
    masters: list[torch.Tensor]  # initial fp32 master of each block (CPU copies)

    @property
    def gpu(self):  # noqa: ANN201
        return self.store.tiers[TierName.GPU]

    def slot_master(self, index: int, slot) -> torch.Tensor:  # noqa: ANN001
        return self.masters[index][slot.offset : slot.offset + slot.numel].view(slot.shape)


def register_state(blocks: list[Block], store: TierStore, homes: dict[str, TierName], compute_dtype: torch.dtype,
                   source: WeightSource, gpu_updated: frozenset[int] = frozenset(),
                   weights_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """What runtime.engine.relocation.register_state does: master from the model, zero moments and gradient, and the
    compute-dtype weights copy when that is the source."""
    masters = []
    for block in blocks:
        master = torch.cat([slot.param.detach().reshape(-1).to(F32) for slot in block.slots])
        masters.append(master.clone())
        f32 = TensorMeta(F32, block.numel)
        if block.index in gpu_updated:
            store.register(block.key("master"), f32, TierName.GPU, init=master)
            for kind in ("exp_avg", "exp_avg_sq"):
                store.register(block.key(kind), f32, TierName.GPU, init=torch.zeros(block.numel))
            continue
        store.register(block.key("master"), f32, homes["master"], init=master)
        for kind in ("exp_avg", "exp_avg_sq"):
            store.register(block.key(kind), f32, homes[kind], init=torch.zeros(block.numel))
        store.register(block.key("grad"), f32, TierName.HOST, init=torch.zeros(block.numel))
        if source is WeightSource.WEIGHTS:
            dtype = weights_dtype or compute_dtype
            store.register(block.key("weights"), TensorMeta(dtype, block.numel), homes.get("weights", TierName.HOST),
                           init=master.to(dtype))
    return masters


@contextmanager
def make_setup(compute_dtype: torch.dtype = F32, source: WeightSource = WeightSource.MASTER,
               homes: dict[str, TierName] | None = None, gpu_updated: frozenset[int] = frozenset(),
               nvme_path: str | None = None, gpu_budget_nbytes: int = 1 << 40,
               weights_dtype: torch.dtype | None = None) -> Iterator[Setup]:
    torch.manual_seed(0)
    model = Tiny()
    blocks = build_blocks(model)
    assert len(blocks) == 5
    homes = {"master": TierName.HOST, "exp_avg": TierName.HOST, "exp_avg_sq": TierName.HOST, **(homes or {})}
    store = TierStore(StoreConfig(device="cpu", pin=False, gpu_budget_nbytes=gpu_budget_nbytes, nvme_path=nvme_path))
    try:
        masters = register_state(blocks, store, homes, compute_dtype, source, gpu_updated, weights_dtype)
        weights = WeightManager(blocks, store, compute_dtype, source, gpu_updated)
        for i in gpu_updated:
            weights.load_resident(i, store.tensor(blocks[i].key("master"), TierName.GPU))
        if source is WeightSource.RESIDENT:
            for block in blocks:
                if block.index not in gpu_updated:
                    weights.load_resident(block.index)
        yield Setup(model, blocks, store, weights, masters)
    finally:
        store.close()


def storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def assert_released(s: Setup, index: int) -> None:
    state = s.weights.states[index]
    assert not state.resident and state.handle is None
    assert not s.weights.is_fetched(index)
    assert storage_nbytes(state.flat) == 0
    for slot in s.blocks[index].slots:
        assert storage_nbytes(slot.param) == 0


def assert_holds_master(s: Setup, index: int, dtype: torch.dtype) -> None:
    for slot in s.blocks[index].slots:
        assert slot.param.dtype == dtype
        assert torch.equal(slot.param.detach(), s.slot_master(index, slot).to(dtype)), slot.name


# ---- tests ---------------------------------------------------------------------------------------------
def test_parameters_are_views_of_the_flat_buffer_holding_zero_bytes_until_fetched():
    with make_setup() as s:
        for index, state in enumerate(s.weights.states):
            assert state.flat.numel() == s.blocks[index].numel
            assert_released(s, index)
        s.weights.wait(2)
        flat = s.weights.states[2].flat
        assert storage_nbytes(flat) == s.weights.nbytes(2) == s.blocks[2].numel * 4
        for slot in s.blocks[2].slots:
            assert slot.param.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert slot.param.data_ptr() == flat.data_ptr() + slot.offset * flat.element_size()
            assert slot.param.shape == slot.shape
        # Writing through the flat buffer is seen by the parameter: they are the same bytes.
        with torch.no_grad():
            flat.fill_(3.0)
        assert all(bool(slot.param.eq(3.0).all()) for slot in s.blocks[2].slots)
        for other in (0, 1, 3, 4):
            assert_released(s, other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fetched_values_equal_the_host_master_cast_to_the_compute_dtype(dtype):
    with make_setup(compute_dtype=dtype) as s:
        assert s.weights.needs_cast == (dtype != F32)
        assert s.weights.source_key(s.blocks[1]) == "block1.master"
        for index in range(len(s.blocks)):
            s.weights.fetch(index, prefetch=True)
        for index in range(len(s.blocks)):
            assert s.weights.wait(index) is True
            assert s.weights.states[index].handle is None  # copied and cast, in pieces on the copy stream
            assert storage_nbytes(s.weights.states[index].flat) == s.blocks[index].numel * dtype.itemsize
            assert_holds_master(s, index, dtype)
        if dtype == F32:  # the model computes with them exactly as the original model does
            torch.manual_seed(0)
            reference = Tiny()
            x = torch.randn(2, 5)
            with torch.no_grad():
                assert torch.equal(s.model(x), reference(x))


def test_weights_source_fetches_the_compute_dtype_host_copy():
    with make_setup(compute_dtype=torch.bfloat16, source=WeightSource.WEIGHTS) as s:
        assert not s.weights.needs_cast
        assert s.weights.source_key(s.blocks[0]) == "block0.weights"
        # Make the host copy differ from the master, to tell which one was fetched.
        host = s.store.tensor("block3.weights", TierName.HOST)
        host.add_(1.0)
        s.store.mark_dirty("block3.weights", TierName.HOST)
        s.weights.wait(3)
        assert torch.equal(s.weights.states[3].flat, host)


def test_weights_source_of_the_wrong_dtype_is_refused_without_leaking():
    with make_setup(compute_dtype=torch.bfloat16, source=WeightSource.WEIGHTS, weights_dtype=F32) as s:
        with pytest.raises(RuntimeError, match="float32"):
            s.weights.fetch(0)
        assert s.gpu.used_nbytes == 0
        assert_released(s, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_tier_accounting_follows_fetch_and_release(dtype):
    with make_setup(compute_dtype=dtype) as s:
        assert s.gpu.used_nbytes == 0
        s.weights.fetch(1)
        assert s.gpu.used_nbytes == s.weights.nbytes(1) == s.blocks[1].numel * dtype.itemsize
        s.weights.fetch(1)  # in flight already: no second reservation
        assert s.gpu.used_nbytes == s.weights.nbytes(1)
        s.weights.wait(1)
        s.weights.wait(4)  # on demand
        assert s.gpu.used_nbytes == s.weights.nbytes(1) + s.weights.nbytes(4) == s.weights.resident_nbytes()
        s.weights.release(1)
        assert s.gpu.used_nbytes == s.weights.nbytes(4) == s.weights.resident_nbytes()
        s.weights.release(1)  # already released: nothing more to return
        assert s.gpu.used_nbytes == s.weights.nbytes(4)
        s.weights.release(4)
        assert s.gpu.used_nbytes == 0 == s.weights.resident_nbytes()
        assert_released(s, 1)
        assert_released(s, 4)


def test_wait_reports_prefetch_hits_and_on_demand_misses():
    with make_setup() as s:
        assert s.weights.wait(0) is False  # not fetched: on-demand fetch
        assert s.weights.states[0].resident
        assert s.weights.wait(0) is True  # resident
        s.weights.fetch(1, prefetch=True)
        assert s.weights.is_fetched(1)
        assert s.weights.wait(1) is True
        s.weights.fetch(2, prefetch=False)
        assert s.weights.wait(2) is False
        for index in (0, 1, 2):
            assert_holds_master(s, index, F32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fetch_then_release_without_wait_leaves_no_leak(dtype):
    with make_setup(compute_dtype=dtype) as s:
        for _ in range(3):
            for index in range(len(s.blocks)):
                s.weights.fetch(index, prefetch=True)
            assert s.gpu.used_nbytes == sum(s.weights.nbytes(i) for i in range(len(s.blocks)))
            for index in range(len(s.blocks)):
                s.weights.release(index)
                assert_released(s, index)
            assert s.gpu.used_nbytes == 0
        # A fetch after that is whole and correct.
        assert s.weights.wait(2) is False
        assert_holds_master(s, 2, dtype)


def test_release_is_a_no_op_while_the_block_has_users():
    with make_setup() as s:
        s.weights.wait(3)
        s.weights.states[3].users = 2
        s.weights.release(3)
        assert s.weights.states[3].resident and storage_nbytes(s.weights.states[3].flat) > 0
        assert s.gpu.used_nbytes == s.weights.nbytes(3)
        assert_holds_master(s, 3, F32)
        s.weights.states[3].users = 0
        s.weights.release(3)
        assert_released(s, 3)
        assert s.gpu.used_nbytes == 0


def test_resident_source_loads_everything_and_never_releases():
    with make_setup(compute_dtype=torch.bfloat16, source=WeightSource.RESIDENT) as s:
        total = sum(s.weights.nbytes(i) for i in range(len(s.blocks)))
        assert s.gpu.used_nbytes == total == s.weights.resident_nbytes()
        for index in range(len(s.blocks)):
            assert s.weights.wait(index) is True
            s.weights.release(index)
            assert s.weights.states[index].resident
            assert_holds_master(s, index, torch.bfloat16)
        assert s.gpu.used_nbytes == total


def test_gpu_updated_blocks_stay_resident():
    with make_setup(gpu_updated=frozenset({0, 1})) as s:
        master_nbytes = sum(4 * 3 * s.blocks[i].numel for i in (0, 1))  # master + two moments on the GPU tier
        assert s.gpu.used_nbytes == master_nbytes + s.weights.nbytes(0) + s.weights.nbytes(1)
        for index in (0, 1):
            s.weights.release(index)
            assert s.weights.states[index].resident
            assert_holds_master(s, index, F32)
        s.weights.wait(2)
        s.weights.release(2)  # an ordinary block is released as usual
        assert_released(s, 2)
        assert s.gpu.used_nbytes == master_nbytes + s.weights.nbytes(0) + s.weights.nbytes(1)


def test_load_resident_from_a_given_device_master_and_again_in_place():
    with make_setup(gpu_updated=frozenset({1})) as s:
        master = s.store.tensor("block1.master", TierName.GPU)
        master.mul_(2.0)
        used = s.gpu.used_nbytes
        s.weights.load_resident(1, master)  # already resident: refilled, nothing more reserved
        assert s.gpu.used_nbytes == used
        assert torch.equal(s.weights.states[1].flat, master)


def test_refetch_after_release_sees_the_new_master():
    with make_setup() as s:
        s.weights.wait(2)
        s.weights.release(2)
        host = s.store.tensor("block2.master", TierName.HOST)
        host.add_(0.5)
        s.store.mark_dirty("block2.master", TierName.HOST)
        s.weights.wait(2)
        assert torch.equal(s.weights.states[2].flat, host)


def test_fetch_over_the_gpu_budget_reserves_nothing():
    with make_setup() as probe:
        sizes = [probe.weights.nbytes(i) for i in range(5)]
    budget = sizes[1] + sizes[2] - 1  # either fits alone, not both
    with make_setup(gpu_budget_nbytes=budget) as s:
        s.weights.fetch(1, prefetch=True)
        with pytest.raises(CapacityError):
            s.weights.fetch(2, prefetch=True)
        assert s.gpu.used_nbytes == sizes[1]
        assert_released(s, 2)
        s.weights.release(1)
        assert s.weights.wait(2) is False
        assert_holds_master(s, 2, F32)
        assert s.gpu.used_nbytes == sizes[2]


def test_master_on_nvme_is_staged_for_fetch_and_for_load_resident(tmpfs_dir):
    homes = {"master": TierName.NVME}
    with make_setup(homes=homes, nvme_path=str(tmpfs_dir)) as s:
        s.weights.wait(1)
        assert_holds_master(s, 1, F32)
    with make_setup(compute_dtype=torch.bfloat16, source=WeightSource.RESIDENT, homes=homes, nvme_path=str(tmpfs_dir)) as s:
        for index in range(len(s.blocks)):
            assert_holds_master(s, index, torch.bfloat16)


def test_held_refreshes_wait_until_released_or_needed():
    """While refreshes are held a resident block keeps its old weights; waiting for one block issues every
    held refresh (in block order), and release_refreshes issues the rest."""
    with make_setup(compute_dtype=torch.bfloat16, source=WeightSource.RESIDENT) as s:
        staging = torch.empty(max(b.numel for b in s.blocks), dtype=F32)
        s.weights.hold_refreshes()
        for index in (3, 1):
            s.store.tensor(s.blocks[index].key("master"), TierName.HOST).mul_(2.0)
            assert s.weights.refresh_resident(index, staging) is None  # queued
            assert s.weights.is_refresh_held(index)
            assert not holds_host_master(s, index)  # the old weights until the refresh goes out
        s.weights.wait_refresh(3)
        for index in (1, 3):
            assert not s.weights.is_refresh_held(index)
            assert holds_host_master(s, index)
        s.store.tensor(s.blocks[2].key("master"), TierName.HOST).mul_(2.0)
        assert s.weights.refresh_resident(2, staging) is not None  # no longer held: issued at once
        assert holds_host_master(s, 2)
        s.weights.hold_refreshes()
        assert s.weights.refresh_resident(4, staging, may_hold=False) is not None  # e.g. an NVMe master
        s.weights.release_refreshes()


def holds_host_master(s: Setup, index: int) -> bool:
    """The block's resident weights equal its host master (now) cast to their dtype."""
    flat = s.weights.states[index].flat
    return torch.equal(flat, s.store.tensor(s.blocks[index].key("master"), TierName.HOST).to(flat.dtype))


def test_a_fetch_whose_staging_cannot_be_allocated_leaves_the_block_holding_nothing(monkeypatch):
    """A fetch from the fp32 master that fails before its copies are issued (no room for the staging piece)
    gives back the weights' bytes and their reservation: the block is released, and a later fetch succeeds."""
    with make_setup(compute_dtype=torch.bfloat16) as s:
        tier = s.store.tiers[TierName.GPU]
        before = tier.used_nbytes
        real = WeightManager._fetch_and_cast

        def no_room(self, key, src, flat):
            raise torch.OutOfMemoryError("no room for the staging piece (a stand-in)")

        monkeypatch.setattr(WeightManager, "_fetch_and_cast", no_room)
        with pytest.raises(torch.OutOfMemoryError):
            s.weights.fetch(2, prefetch=True)
        assert_released(s, 2)
        assert tier.used_nbytes == before
        monkeypatch.setattr(WeightManager, "_fetch_and_cast", real)
        assert s.weights.wait(2) is False  # fetched on demand now
        assert_holds_master(s, 2, torch.bfloat16)


@pytest.mark.parametrize("used", [True, False])
def test_a_fetch_whose_copy_fails_leaves_the_block_holding_nothing(monkeypatch, used):
    """A fetch from the fp32 master whose second piece's copy fails: waiting for it raises the copy's error (a
    prefetch never used is released with a warning instead); either way the block's bytes and their reservation
    go back, and a later fetch succeeds."""
    import runtime.engine.weights as weights_module
    from tierstore import Handle

    monkeypatch.setattr(weights_module, "FETCH_PIECE_NUMEL", 8)  # several pieces a block
    with make_setup(compute_dtype=torch.bfloat16) as s:
        tier = s.store.tiers[TierName.GPU]
        before = tier.used_nbytes
        engine = s.store.engine
        real = engine.h2d_then
        calls = []

        def second_fails(key, src, dst, then, after=None, order_after_current=True):
            calls.append(key)
            if len(calls) == 2:
                failed = Handle("h2d", key, "host", "gpu", src.numel() * src.element_size(), None)
                failed._fail(OSError("planted copy failure"))
                return failed
            return real(key, src, dst, then, after, order_after_current)

        monkeypatch.setattr(engine, "h2d_then", second_fails)
        s.weights.fetch(2, prefetch=True)
        assert len(calls) == 2 and tier.used_nbytes > before  # the pieces after the failure are not issued
        if used:
            with pytest.raises(OSError, match="planted copy failure"):
                s.weights.wait(2)
        else:
            s.weights.release(2)
        assert_released(s, 2)
        assert tier.used_nbytes == before
        monkeypatch.setattr(engine, "h2d_then", real)
        assert s.weights.wait(2) is False  # fetched on demand now
        assert_holds_master(s, 2, torch.bfloat16)
