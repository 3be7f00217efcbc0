"""TierStore: bit-exact round trips through every path, budgets per tier, residency rules, lifetime."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.unit.tierstore.tensors import as_bytes, random_tensor
from tierstore import (
    CapacityError,
    CopyState,
    DirectoryLockedError,
    GpuTier,
    HostTier,
    NVMeDirectory,
    NvmeTier,
    StoreConfig,
    TensorKey,
    TensorMeta,
    TierName,
    TierStore,
    TierStoreError,
    TransferEvent,
)
from tierstore.nvme import HEADER_NBYTES, SUFFIX
from tierstore.transfer import Handle

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]
NUMELS = [0, 1, 4097, (3 << 20) // 4 + 3]
S = CopyState






def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def swap_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(SUFFIX))


def file_payload(directory: Path, key: str, nbytes: int) -> bytes:
    with open(directory / f"{TensorKey(key).file_stem()}{SUFFIX}", "rb") as f:
        f.seek(HEADER_NBYTES)
        return f.read(nbytes)


class Moved:
    """Sums the bytes of published transfer events per (kind, src, dst)."""

    def __init__(self, store: TierStore) -> None:
        self.bytes: Counter[tuple[str, str, str]] = Counter()
        self.count = 0
        self._lock = threading.Lock()
        store.bus.subscribe(self)

    def __call__(self, event: TransferEvent) -> None:
        with self._lock:
            self.bytes[(event.kind, event.src_tier, event.dst_tier)] += event.nbytes
            self.count += 1

    def take(self) -> dict[tuple[str, str, str], int]:
        with self._lock:
            out = {k: v for k, v in self.bytes.items() if v}
            self.bytes.clear()
            return out


@pytest.fixture
def make_store(device: torch.device):
    stores: list[TierStore] = []

    def make(**kwargs) -> TierStore:
        kwargs.setdefault("device", str(device))
        kwargs.setdefault("host_budget_nbytes", 32 << 20)
        store = TierStore(StoreConfig(**kwargs))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


# ---- round trips through every path ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", NUMELS)
def test_host_gpu_round_trip(make_store, dtype: torch.dtype, numel: int) -> None:
    store = make_store()
    moved = Moved(store)
    data, update = random_tensor(dtype, numel, 1), random_tensor(dtype, numel, 2)
    nbytes = data.numel() * data.element_size()
    store.register("w", TensorMeta.of(data), "host", init=data)
    assert same_bits(store.tensor("w", "host"), data)

    store.fetch("w", "gpu").wait()  # host -> gpu
    assert store.state("w", "gpu") is S.CLEAN
    assert same_bits(store.tensor("w", "gpu"), data)
    assert store.tensor("w", "gpu").device.type == store.device.type
    assert moved.take() == ({("h2d", "host", "gpu"): nbytes} if nbytes else {})

    store.tensor("w", "gpu").copy_(update.to(store.device))
    store.mark_dirty("w", "gpu")
    assert (store.state("w", "gpu"), store.state("w", "host")) == (S.DIRTY, S.STALE)
    store.evict("w", "gpu").wait()  # gpu -> host, then the gpu copy is released
    assert (store.state("w", "gpu"), store.state("w", "host")) == (S.ABSENT, S.CLEAN)
    assert same_bits(store.tensor("w", "host"), update)
    assert store.usage()["gpu"]["used_nbytes"] == 0
    assert moved.take() == ({("d2h", "gpu", "host"): nbytes} if nbytes else {})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", NUMELS)
def test_nvme_paths_round_trip(make_store, nvme_dir: Path, dtype: torch.dtype, numel: int) -> None:
    """host -> nvme (init), nvme -> gpu (staged through host), gpu -> nvme (through host), nvme -> host:
    bit-exact at each stop, the bytes in the file itself, and each hop's bytes seen on the event bus."""
    store = make_store(nvme_path=str(nvme_dir), nvme_budget_nbytes=64 << 20)
    moved = Moved(store)
    data, update = random_tensor(dtype, numel, 3), random_tensor(dtype, numel, 4)
    nbytes = data.numel() * data.element_size()
    store.register("opt/m", TensorMeta.of(data), "nvme", init=data)
    assert file_payload(nvme_dir, "opt/m", nbytes) == as_bytes(data).numpy().tobytes()
    assert moved.take() == ({("write", "host", "nvme"): nbytes} if nbytes else {})
    assert store.usage()["host"]["used_nbytes"] == 0  # the staging buffer was returned

    store.fetch("opt/m", "gpu").wait()  # nvme -> host -> gpu
    assert same_bits(store.tensor("opt/m", "gpu"), data)
    assert (store.state("opt/m", "host"), store.state("opt/m", "gpu")) == (S.CLEAN, S.CLEAN)
    assert moved.take() == ({("read", "nvme", "host"): nbytes, ("h2d", "host", "gpu"): nbytes} if nbytes else {})

    store.tensor("opt/m", "gpu").copy_(update.to(store.device))
    store.mark_dirty("opt/m", "gpu", step=7)
    assert [store.state("opt/m", t) for t in ("gpu", "host", "nvme")] == [S.DIRTY, S.STALE, S.STALE]
    store.evict("opt/m", "gpu", "host").wait()  # gpu -> host ...
    assert [store.state("opt/m", t) for t in ("gpu", "host", "nvme")] == [S.ABSENT, S.DIRTY, S.STALE]
    store.evict("opt/m", "host").wait()  # ... -> nvme, then the host copy goes
    assert [store.state("opt/m", t) for t in ("gpu", "host", "nvme")] == [S.ABSENT, S.ABSENT, S.CLEAN]
    assert file_payload(nvme_dir, "opt/m", nbytes) == as_bytes(update).numpy().tobytes()
    assert moved.take() == ({("d2h", "gpu", "host"): nbytes, ("write", "host", "nvme"): nbytes} if nbytes else {})
    assert store.usage()["host"]["used_nbytes"] == 0 and store.usage()["gpu"]["used_nbytes"] == 0
    swap = store.record("opt/m").copies[store.record("opt/m").home].allocation.swap
    assert store._nvme_dir.read_step(swap) == 7

    store.fetch("opt/m", "host").wait()  # nvme -> host
    assert same_bits(store.tensor("opt/m", "host"), update)
    assert moved.take() == ({("read", "nvme", "host"): nbytes} if nbytes else {})


def test_fetch_of_a_current_copy_moves_nothing(make_store, nvme_dir: Path) -> None:
    store = make_store(nvme_path=str(nvme_dir))
    moved = Moved(store)
    store.register("k", TensorMeta(torch.float32, 1000), "nvme", init=torch.ones(1000))
    store.fetch("k", "gpu").wait()
    events = moved.count
    handle = store.fetch("k", "gpu")
    assert handle.done() and handle.nbytes == 0
    store.fetch("k", "host").wait()
    assert moved.count == events


def test_a_snapshot_reads_the_current_value_and_moves_nothing(make_store, nvme_dir: Path) -> None:
    """From the host copy, the device copy (after an update there) and the NVMe file (no host copy): the value,
    bit for bit, with every copy's state as it was and no transfer made."""
    store = make_store(nvme_path=str(nvme_dir))
    moved = Moved(store)
    value = random_tensor(torch.float32, 1000)
    store.register("host", TensorMeta(torch.float32, 1000), "host", init=value)
    store.register("disk", TensorMeta(torch.float32, 1000), "nvme", init=value * 2)
    store.fetch("host", "gpu").wait()
    store.tensor("host", "gpu").mul_(3)  # an update on the device: the GPU copy is the newest
    store.mark_dirty("host", "gpu")
    states = {(k, t): store.state(k, t) for k in ("host", "disk") for t in ("host", "gpu", "nvme")}
    events = moved.count
    assert same_bits(store.snapshot("host"), value * 3)
    assert same_bits(store.snapshot("disk"), value * 2)
    assert {(k, t): store.state(k, t) for k in ("host", "disk") for t in ("host", "gpu", "nvme")} == states
    assert moved.count == events
    store.evict("host", "gpu").wait()  # written back home: read from the host copy now
    assert same_bits(store.snapshot("host"), value * 3)


def test_a_copy_read_ahead_is_released_once_it_lands(make_store, nvme_dir: Path) -> None:
    store = make_store(nvme_path=str(nvme_dir))
    store.register("k", TensorMeta(torch.float32, 1000), "nvme", init=torch.ones(1000))
    used = store.usage()["host"]["used_nbytes"]
    store.fetch("k", "host")  # not waited for: release_read_ahead waits for the read first
    store.release_read_ahead("k", "host")
    assert store.state("k", "host") is CopyState.ABSENT and store.usage()["host"]["used_nbytes"] == used
    store.release_read_ahead("k", "host")  # no copy: nothing to do
    with pytest.raises(RuntimeError, match="home copy"):
        store.release_read_ahead("k", "nvme")


def test_wait_written_returns_once_the_write_home_and_its_release_have_run(make_store, nvme_dir: Path,
                                                                           monkeypatch) -> None:
    """A host copy written back to its NVMe home with release: wait_written (not waiting on the write's handle)
    returns with the write landed and the host copy already released, so nobody modifies a copy a write is
    still reading or is about to free."""
    import threading

    from tierstore.nvme import NVMeDirectory

    store = make_store(nvme_path=str(nvme_dir))
    store.register("k", TensorMeta(torch.float32, 1 << 20), "nvme", init=torch.zeros(1 << 20))
    store.fetch("k", "host").wait()
    store.tensor("k", "host").fill_(3.0)
    store.mark_dirty("k", "host")
    gate, write = threading.Event(), NVMeDirectory.write

    def gated_write(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - the write waits for the gate
        if not gate.wait(10.0):
            raise RuntimeError("the gate never opened")
        return write(self, *args, **kwargs)

    monkeypatch.setattr(NVMeDirectory, "write", gated_write)
    store.evict("k", "host")  # written back, then released; the handle is dropped
    assert store.state("k", "host") is not CopyState.ABSENT  # the write is held at the gate
    threading.Timer(0.2, gate.set).start()
    store.wait_written("k")
    assert gate.is_set()  # it returned only after the write could run
    assert store.state("k", "host") is CopyState.ABSENT and store.state("k", "nvme").is_current
    store.fetch("k", "host").wait()
    assert torch.equal(store.tensor("k", "host"), torch.full((1 << 20,), 3.0))
    store.register("h", TensorMeta(torch.float32, 10), "host", init=torch.ones(10))
    store.wait_written("h")  # another home: nothing to wait for


def test_register_without_init_on_nvme_reads_zeros(make_store, nvme_dir: Path) -> None:
    store = make_store(nvme_path=str(nvme_dir))
    store.register("z", TensorMeta(torch.float16, 3000), "nvme")
    store.fetch("z", "host").wait()
    assert bool((store.tensor("z", "host") == 0).all())


def test_direct_gpu_to_nvme_evict_is_refused_without_changing_state(make_store, nvme_dir: Path) -> None:
    store = make_store(nvme_path=str(nvme_dir))
    data = random_tensor(torch.float32, 500, 5)
    store.register("k", TensorMeta.of(data), "nvme", init=torch.zeros(500))
    store.fetch("k", "gpu").wait()
    store.tensor("k", "gpu").copy_(data.to(store.device))
    store.mark_dirty("k", "gpu")
    states = [store.state("k", t) for t in ("gpu", "host", "nvme")]
    with pytest.raises(TierStoreError, match="through host"):
        store.evict("k", "gpu")  # home is nvme
    assert [store.state("k", t) for t in ("gpu", "host", "nvme")] == states
    store.evict("k", "gpu", "host").wait()
    store.evict("k", "host").wait()
    store.fetch("k", "host").wait()
    assert same_bits(store.tensor("k", "host"), data)


# ---- budgets ---------------------------------------------------------------------------------------------
def _usage(store: TierStore) -> dict:
    return {tier: u["used_nbytes"] for tier, u in store.usage().items()}


def test_gpu_budget(make_store) -> None:
    store = make_store(gpu_budget_nbytes=6000)
    store.register("a", TensorMeta(torch.float32, 1000), "host", init=torch.ones(1000))
    store.register("b", TensorMeta(torch.float32, 1000), "host", init=torch.ones(1000))
    store.fetch("a", "gpu").wait()
    before = _usage(store)
    with pytest.raises(CapacityError) as info:
        store.fetch("b", "gpu")
    message = str(info.value)
    assert "gpu tier is full" in message and "b needs 4,000 bytes" in message and "2,000 of 6,000" in message
    assert _usage(store) == before and store.state("b", "gpu") is S.ABSENT
    store.release("a", "gpu")
    store.fetch("b", "gpu").wait()  # fits once a is gone
    assert _usage(store)["gpu"] == 4000


def test_host_budget(make_store) -> None:
    store = make_store(host_budget_nbytes=3 * 4096)
    store.register("a", TensorMeta(torch.uint8, 8192), "host")
    before = _usage(store)
    with pytest.raises(CapacityError, match="host tier is full") as info:
        store.register("b", TensorMeta(torch.uint8, 4097), "host")
    assert "b needs 8,192 bytes" in str(info.value)
    assert _usage(store) == before and store.keys() == [TensorKey("a")]
    store.register("c", TensorMeta(torch.uint8, 4096), "host")


def test_nvme_budget_leaves_no_file(make_store, nvme_dir: Path) -> None:
    meta = TensorMeta(torch.float32, 2048)  # one 8 KiB payload + 4 KiB header
    store = make_store(nvme_path=str(nvme_dir), nvme_budget_nbytes=2 * NVMeDirectory.file_size(meta))
    store.register("a", meta, "nvme")
    store.register("b", meta, "nvme")
    before, files = _usage(store), swap_files(nvme_dir)
    with pytest.raises(CapacityError, match="nvme tier is full"):
        store.register("c", TensorMeta(torch.uint8, 1), "nvme")
    assert _usage(store) == before and swap_files(nvme_dir) == files
    assert TensorKey("c") not in store.keys()


def test_nvme_register_rolls_back_when_staging_does_not_fit(make_store, nvme_dir: Path) -> None:
    """Writing the initial value needs a host staging buffer; when that is over the host budget the NVMe
    reservation and its file must go too (nothing half-registered)."""
    store = make_store(nvme_path=str(nvme_dir), host_budget_nbytes=4096)
    before = _usage(store)
    with pytest.raises(CapacityError, match="host tier is full"):
        store.register("big", TensorMeta(torch.uint8, 8192), "nvme", init=torch.zeros(8192, dtype=torch.uint8))
    assert _usage(store) == before and swap_files(nvme_dir) == [] and store.keys() == []
    store.register("big", TensorMeta(torch.uint8, 4096), "nvme")  # the key is free again


def test_fetch_over_gpu_budget_keeps_the_staged_host_copy_whole(make_store, nvme_dir: Path) -> None:
    store = make_store(nvme_path=str(nvme_dir), gpu_budget_nbytes=100)
    data = random_tensor(torch.int64, 1000, 6)
    store.register("k", TensorMeta.of(data), "nvme", init=data)
    with pytest.raises(CapacityError, match="gpu"):
        store.fetch("k", "gpu")
    assert _usage(store)["gpu"] == 0 and store.state("k", "gpu") is S.ABSENT
    assert same_bits(store.tensor("k", "host"), data)  # the staged copy is complete, not half-written


def test_init_mismatch_reserves_nothing(make_store) -> None:
    store = make_store()
    with pytest.raises(ValueError, match="expected torch.float32 x10"):
        store.register("k", TensorMeta(torch.float32, 10), "host", init=torch.zeros(11))
    with pytest.raises(ValueError):
        store.register("k", TensorMeta(torch.float32, 10), "host", init=torch.zeros(10, dtype=torch.float64))
    assert _usage(store)["host"] == 0 and store.keys() == []


def test_tiers_by_name_each_of_its_own_class(make_store, tmpfs_dir: Path) -> None:
    """store.tiers is looked up like a dict keyed by TierName (the name's value too), and each tier is its own class:
    what only one tier does (the GPU's reserve, the host's arena, the NVMe tier's directory) is reached by its name."""
    store = make_store()
    assert list(store.tiers) == [TierName.GPU, TierName.HOST] and len(store.tiers) == 2
    assert store.tiers["host"] is store.tiers[TierName.HOST] is store.tiers.host
    assert isinstance(store.tiers[TierName.GPU], GpuTier) and isinstance(store.tiers[TierName.HOST], HostTier)
    assert TierName.NVME not in store.tiers and "tape" not in store.tiers and store.tiers.nvme is None
    assert store.tiers.get(TierName.NVME) is None
    with pytest.raises(KeyError):
        store.tiers[TierName.NVME]
    with pytest.raises(KeyError):
        store.tiers["tape"]
    store.tiers[TierName.GPU].reserve(4096, "a caller's own buffer")
    assert store.usage()["gpu"]["used_nbytes"] == 4096
    store.tiers[TierName.GPU].unreserve(4096)
    with_nvme = make_store(nvme_path=str(tmpfs_dir))
    assert isinstance(with_nvme.tiers[TierName.NVME], NvmeTier) and with_nvme.tiers["nvme"] is with_nvme.tiers.nvme
    assert with_nvme.tiers[TierName.NVME].directory.path == tmpfs_dir and TierName.NVME in with_nvme.tiers
    assert {name: tier.capacity_nbytes for name, tier in with_nvme.tiers.items()} == {
        TierName(name): figures["capacity_nbytes"] for name, figures in with_nvme.usage().items()}


# ---- residency rules --------------------------------------------------------------------------------------
def test_release_rules(make_store) -> None:
    store = make_store()
    store.register("k", TensorMeta(torch.float32, 100), "host", init=torch.ones(100))
    with pytest.raises(RuntimeError, match="home copy"):
        store.release("k", "host")
    store.fetch("k", "gpu").wait()
    store.release("k", "gpu")  # clean: dropped without writing
    assert store.state("k", "gpu") is S.ABSENT and _usage(store)["gpu"] == 0
    store.release("k", "gpu")  # absent: nothing to do
    store.fetch("k", "gpu").wait()
    store.mark_dirty("k", "gpu")
    with pytest.raises(RuntimeError, match="only current copy"):
        store.release("k", "gpu")
    assert store.state("k", "gpu") is S.DIRTY and _usage(store)["gpu"] == 400


def test_dirty_copy_may_go_while_a_twin_is_current(make_store, nvme_dir: Path) -> None:
    """A DIRTY gpu copy whose value was also written to host (DIRTY there too) is not the last current copy."""
    store = make_store(nvme_path=str(nvme_dir))
    store.register("k", TensorMeta(torch.float32, 100), "nvme", init=torch.zeros(100))
    store.fetch("k", "gpu").wait()
    store.tensor("k", "gpu").fill_(3)
    store.mark_dirty("k", "gpu")
    store.evict("k", "gpu", "host", release=False).wait()
    assert (store.state("k", "gpu"), store.state("k", "host")) == (S.DIRTY, S.DIRTY)
    store.release("k", "gpu")
    with pytest.raises(RuntimeError, match="only current copy"):
        store.release("k", "host")
    assert bool((store.tensor("k", "host") == 3).all())


def test_mark_dirty_and_evict_need_a_current_copy(make_store) -> None:
    store = make_store()
    store.register("k", TensorMeta(torch.float32, 10), "host", init=torch.ones(10))
    with pytest.raises(RuntimeError, match="only a current copy"):
        store.mark_dirty("k", "gpu")
    with pytest.raises(RuntimeError, match="nothing to evict"):
        store.evict("k", "gpu")
    with pytest.raises(RuntimeError, match="fetch it first"):
        store.tensor("k", "gpu")
    store.fetch("k", "gpu").wait()
    store.mark_dirty("k", "host")  # the host copy changed: the gpu copy is out of date
    assert store.state("k", "gpu") is S.STALE
    with pytest.raises(RuntimeError, match="fetch it first"):
        store.tensor("k", "gpu")
    with pytest.raises(ValueError, match="toward a lower tier"):
        store.evict("k", "host", "gpu")
    with pytest.raises(ValueError, match="use evict"):
        store.fetch("k", "nvme")


def test_evict_release_false_keeps_a_clean_copy(make_store) -> None:
    store = make_store()
    store.register("k", TensorMeta(torch.float32, 10), "host", init=torch.zeros(10))
    store.fetch("k", "gpu").wait()
    store.tensor("k", "gpu").fill_(2)
    store.mark_dirty("k", "gpu")
    store.evict("k", "gpu", release=False).wait()
    assert (store.state("k", "gpu"), store.state("k", "host")) == (S.CLEAN, S.CLEAN)
    assert bool((store.tensor("k", "host") == 2).all())
    store.evict("k", "gpu").wait()  # clean: released without another copy
    assert store.state("k", "gpu") is S.ABSENT


def test_stale_copy_is_refreshed_by_fetch(make_store) -> None:
    store = make_store()
    store.register("k", TensorMeta(torch.float32, 10), "host", init=torch.zeros(10))
    store.fetch("k", "gpu").wait()
    store.tensor("k", "host").fill_(5)
    store.mark_dirty("k", "host")
    store.fetch("k", "gpu").wait()
    assert store.state("k", "gpu") is S.CLEAN and bool((store.tensor("k", "gpu") == 5).all())


def test_registry_errors(make_store) -> None:
    store = make_store()
    store.register("k", TensorMeta(torch.float32, 10), "host")
    with pytest.raises(KeyError, match="already registered"):
        store.register("k", TensorMeta(torch.float32, 10), "host")
    with pytest.raises(TierStoreError, match="not configured"):
        store.register("n", TensorMeta(torch.float32, 10), "nvme")
    with pytest.raises(ValueError, match="not valid"):
        store.register("bad key", TensorMeta(torch.float32, 10), "host")


# ---- lifetime --------------------------------------------------------------------------------------------
def test_unregister_and_close_return_everything(make_store, nvme_dir: Path) -> None:
    store = make_store(nvme_path=str(nvme_dir))
    for i, home in enumerate(["host", "nvme", "nvme"]):
        store.register(f"k{i}", TensorMeta(torch.float32, 5000), home, init=torch.full((5000,), float(i)))
        store.fetch(f"k{i}", "gpu").wait()
    assert all(_usage(store).values())
    store.unregister("k1")
    assert swap_files(nvme_dir) == [f"k2{SUFFIX}"]
    with pytest.raises(DirectoryLockedError):
        NVMeDirectory(nvme_dir, 1 << 20)
    store.close()
    store.close()  # idempotent
    assert swap_files(nvme_dir) == []
    assert _usage(store) == {"gpu": 0, "host": 0, "nvme": 0}
    NVMeDirectory(nvme_dir, 1 << 20).close()  # unlocked


def test_second_store_on_the_same_directory_is_refused(make_store, nvme_dir: Path) -> None:
    make_store(nvme_path=str(nvme_dir))
    with pytest.raises(DirectoryLockedError, match=r"held by an object of this same process .* never closed: close it "
                                                   r"first \(a training session: `optimizer.session.close\(\)`\)"):
        TierStore(StoreConfig(nvme_path=str(nvme_dir), host_budget_nbytes=4096))


def test_a_store_that_fails_to_build_removes_its_temporary_directory(monkeypatch) -> None:
    import tierstore.store as store_module

    made: list[str] = []
    real = store_module.tempfile.TemporaryDirectory

    def tracked(*args, **kwargs):
        made.append((tmp := real(*args, **kwargs)).name)
        return tmp

    def refused(*args, **kwargs):
        raise DirectoryLockedError("in use by another run")

    monkeypatch.setattr(store_module.tempfile, "TemporaryDirectory", tracked)
    monkeypatch.setattr(store_module, "NVMeDirectory", refused)
    with pytest.raises(DirectoryLockedError) as info:
        TierStore(StoreConfig(nvme_path="tmp", host_budget_nbytes=4096))
    assert made and not Path(made[0]).exists()  # gone now, not when the failed store is collected
    assert info.traceback  # (the traceback keeps the failed store alive: cleanup cannot wait for it)


def test_tmp_nvme_directory_is_created_and_removed(make_store) -> None:
    store = make_store(nvme_path="tmp")
    path = Path(store._nvme_dir.path)
    store.register("k", TensorMeta(torch.uint8, 10), "nvme")
    assert path.is_dir() and swap_files(path)
    store.close()
    assert not path.exists()


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_io_mode_is_reported(make_store, nvme_dir: Path, direct_io: str) -> None:
    store = make_store(nvme_path=str(nvme_dir), direct_io=direct_io)
    assert store.nvme_io_mode in ("direct", "buffered")
    if direct_io == "off":
        assert store.nvme_io_mode == "buffered"
    assert make_store().nvme_io_mode is None


def test_slow_listener_does_not_race_the_state(make_store, nvme_dir: Path) -> None:
    """A listener that takes its time (a profiler writing a trace) delays completion on the IO thread; the
    caller's wait() must still see the settled states, the released copy and the freed bytes."""
    store = make_store(nvme_path=str(nvme_dir))
    store.bus.subscribe(lambda event: time.sleep(0.005))  # the slow listener under test
    for i in range(8):
        key = f"k{i}"
        store.register(key, TensorMeta(torch.float32, 1000), "nvme", init=torch.full((1000,), float(i)))
        store.fetch(key, "gpu")
        assert bool((store.tensor(key, "gpu") == i).all())
        store.mark_dirty(key, "gpu")
        store.evict(key, "gpu", "host").wait()
        assert _usage(store)["gpu"] == 0
        store.evict(key, "host").wait()
        assert _usage(store)["host"] == 0 and store.state(key, "nvme") is S.CLEAN
        store.unregister(key)
    assert _usage(store) == {"gpu": 0, "host": 0, "nvme": 0}


def test_a_fetch_waiting_under_the_lock_for_queued_io_is_not_held_up_by_completion_callbacks(
        make_store, nvme_dir: Path, monkeypatch) -> None:
    """A fetch holds the store's lock while it waits for a read still queued on the IO threads; the callbacks of
    transfers those threads just finished need the same lock. They must not run on the IO threads, or the read
    never starts and both sides wait for ever. One IO thread; the write's completion is slowed before its callbacks
    run, so that the fetch takes the lock first (on the IO thread, as before the done pool, this hangs)."""
    store = make_store(nvme_path=str(nvme_dir), io_threads=1)
    value = {k: random_tensor(torch.float32, 50_000, i) for i, k in enumerate(("written", "read"))}
    for key, tensor in value.items():
        store.register(key, TensorMeta.of(tensor), "nvme", init=tensor)
    store.fetch("written", "host").wait()
    store.mark_dirty("written", "host")
    finish = Handle._finish
    finishing = threading.Event()

    def slow_finish(handle: Handle) -> None:
        if handle.key == "written" and handle.dst_tier == "nvme":
            finishing.set()
            time.sleep(0.3)  # the slow completion under test: the fetch below takes the lock meanwhile
        finish(handle)

    monkeypatch.setattr(Handle, "_finish", slow_finish)
    written = store.evict("written", "host")  # its callbacks (settle, release) will want the lock
    queued = store.fetch("read", "host")  # queued behind the write on the one IO thread
    assert finishing.wait(20), "the write never finished"  # it has, and its completion is sleeping
    done = threading.Event()

    def fetch_to_gpu() -> None:
        store.fetch("read", "gpu").wait()  # under the lock: waits for the queued read
        done.set()

    threading.Thread(target=fetch_to_gpu, daemon=True).start()
    assert done.wait(20), "the fetch and the write's completion callback wait for each other"
    written.wait()
    queued.wait()
    assert same_bits(store.tensor("read", "gpu"), value["read"])
    assert store.state("written", "nvme") is S.CLEAN and store.state("written", "host") is S.ABSENT


def test_wait_written_sees_the_eviction_s_release_so_a_copy_modified_after_it_is_kept(
        make_store, nvme_dir: Path, monkeypatch) -> None:
    """``wait_written`` is what the optimizer calls before it modifies a host copy in place: once it returns, the
    eviction's release of that copy must have run. Released in a separate callback after the write's settle, a
    slow release (another thread holding the lock) let ``wait_written`` return in between: the copy was then
    modified, marked dirty, and freed by the late release, the key left with no current copy (found by a review
    under natural timing with four IO threads: 2-3 failed updates in a few hundred)."""
    store = make_store(nvme_path=str(nvme_dir), io_threads=1)
    value = torch.arange(50_000, dtype=torch.float32)
    store.register("k", TensorMeta.of(value), "nvme", init=value)
    store.fetch("k", "host").wait()
    store.mark_dirty("k", "host", step=1)
    release = TierStore._release_after_evict

    releasing = threading.Event()

    def slow_release(self, record, tier):
        releasing.set()
        time.sleep(0.3)  # the slow release under test (another thread holding the lock)
        release(self, record, tier)

    monkeypatch.setattr(TierStore, "_release_after_evict", slow_release)
    written = store.evict("k", "host")
    assert releasing.wait(20), "the write never landed"  # it has; its completion is under way
    store.wait_written("k")
    assert store.state("k", "host") is S.ABSENT  # the release ran before wait_written returned
    store.fetch("k", "host").wait()  # what the optimizer does next: read it back, update it in place
    store.tensor("k", "host").add_(1)
    store.mark_dirty("k", "host", step=2)
    written.wait()
    assert store.state("k", "host") is S.DIRTY
    assert same_bits(store.tensor("k", "host"), value + 1)


def test_concurrent_fetches_of_many_keys(make_store, nvme_dir: Path) -> None:
    store = make_store(nvme_path=str(nvme_dir), io_threads=4)
    moved = Moved(store)
    values = {f"k{i}": random_tensor(torch.float32, 20_000 + i, i) for i in range(12)}
    for key, value in values.items():
        store.register(key, TensorMeta.of(value), "nvme", init=value)
    moved.take()
    handles = [store.fetch(key, "gpu") for key in values]  # all in flight at once
    for handle in handles:
        handle.wait()
    for key, value in values.items():
        assert same_bits(store.tensor(key, "gpu"), value)
    total = sum(v.numel() * 4 for v in values.values())
    assert moved.take() == {("read", "nvme", "host"): total, ("h2d", "host", "gpu"): total}


# ---- on a GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_every_path_on_the_gpu_with_pinned_host(tmpfs_dir: Path) -> None:
    with TierStore(StoreConfig(device="cuda", host_budget_nbytes=16 << 20, pin=True, nvme_path=str(tmpfs_dir))) as store:
        assert store.tiers["host"].arena.pinned
        moved: list[TransferEvent] = []
        store.bus.subscribe(moved.append)
        data = random_tensor(torch.bfloat16, (2 << 20) + 1, 8)
        store.register("w", TensorMeta.of(data), "nvme", init=data)
        store.fetch("w", "gpu").wait()
        gpu = store.tensor("w", "gpu")
        assert gpu.is_cuda and same_bits(gpu, data)
        gpu.add_(1)  # a kernel on the current stream; the d2h below must be ordered after it
        expected = gpu.cpu()
        store.mark_dirty("w", "gpu")
        store.evict("w", "gpu", "host").wait()
        store.evict("w", "host").wait()
        store.fetch("w", "host").wait()
        assert same_bits(store.tensor("w", "host"), expected)
        stream_events = [e for e in moved if e.kind in ("h2d", "d2h")]
        assert {e.kind for e in stream_events} == {"h2d", "d2h"}
        assert all(e.device_s is not None and e.nbytes == data.numel() * 2 for e in stream_events)


# ---- second host buffers ----------------------------------------------------------------------------------
def test_exchange_host_publishes_a_spare_and_returns_the_old_buffer(make_store) -> None:
    store = make_store(host_budget_nbytes=1 << 20)
    meta = TensorMeta(torch.float32, 1000)
    old_value = torch.arange(1000, dtype=torch.float32)
    store.register("k", meta, TierName.HOST, init=old_value)
    used = store.tiers[TierName.HOST].used_nbytes
    spare = store.allocate_spare("k")
    assert store.tiers[TierName.HOST].used_nbytes > used  # the spare counts against the host budget
    spare.tensor.copy_(old_value * 2)
    assert torch.equal(store.tensor("k", TierName.HOST), old_value)  # writing the spare leaves the copy alone
    returned = store.exchange_host("k", spare, step=7)
    assert torch.equal(store.tensor("k", TierName.HOST), old_value * 2)
    assert torch.equal(returned.tensor, old_value)
    assert store.record("k").step == 7 and store.state("k", TierName.HOST) is CopyState.CLEAN
    store.free_spare(returned)
    assert store.tiers[TierName.HOST].used_nbytes == used


def test_spare_beyond_the_host_budget_is_refused(make_store) -> None:
    store = make_store(host_budget_nbytes=1 << 16)
    store.register("k", TensorMeta(torch.float32, 10000), TierName.HOST)
    with pytest.raises(CapacityError):
        store.allocate_spare("k")


def test_exchange_refuses_a_spare_of_another_size(make_store) -> None:
    store = make_store(host_budget_nbytes=1 << 20)
    store.register("a", TensorMeta(torch.float32, 100), TierName.HOST)
    store.register("b", TensorMeta(torch.float32, 200), TierName.HOST)
    spare = store.allocate_spare("b")
    with pytest.raises(RuntimeError, match="can't replace"):
        store.exchange_host("a", spare)


@pytest.mark.parametrize("start", [TierName.HOST, TierName.NVME])
def test_move_home_keeps_value_and_step_and_frees_the_old_home(make_store, tmp_path, start):
    store = make_store(gpu_budget_nbytes=1 << 20, nvme_path=str(tmp_path))
    value = random_tensor(torch.float32, 4097, seed=3)
    store.register("k", TensorMeta(torch.float32, 4097), start, init=value)
    step = 0
    if start is TierName.HOST:  # a value of step 7, written in place
        store.mark_dirty("k", start, step=7)
        step = 7
    else:
        assert swap_files(tmp_path) == ["k" + SUFFIX]
    host_used = store.tiers[TierName.HOST].used_nbytes
    moved = store.move_home("k", TierName.GPU)
    assert moved.home is TierName.GPU and moved.step == step and store.has("k")
    assert same_bits(store.tensor("k", TierName.GPU).cpu(), value)
    assert store.tiers[TierName.GPU].used_nbytes == 4097 * 4
    assert store.tiers[TierName.HOST].used_nbytes < host_used if start is TierName.HOST else True
    assert swap_files(tmp_path) == []  # nothing left behind on the old home
    assert store.move_home("k", TierName.GPU) is moved  # already there: nothing to do


@pytest.mark.parametrize("start", [TierName.HOST, TierName.NVME])
def test_move_home_without_room_leaves_the_key_where_it_was(make_store, tmp_path, start):
    """Value, home and step as they were, readable again (an NVMe home's header records the step it expects)."""
    store = make_store(gpu_budget_nbytes=1 << 10, nvme_path=str(tmp_path))
    value = random_tensor(torch.float32, 4097, seed=4)
    store.register("k", TensorMeta(torch.float32, 4097), start, init=value, step=5)
    with pytest.raises(CapacityError):
        store.move_home("k", TierName.GPU)
    record = store.record("k")
    assert record.home is start and record.step == 5 and store.tiers[TierName.GPU].used_nbytes == 0
    store.fetch("k", TierName.HOST).wait()
    assert same_bits(store.tensor("k", TierName.HOST), value)
    assert not store.has("other")
