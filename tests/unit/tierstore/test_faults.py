"""Faults: a full file system, a failing write, a truncated or corrupted file under a live store.

The full file system is a real size-limited tmpfs mounted for the test (root only; skipped otherwise).
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.unit.tierstore.tensors import as_bytes, random_tensor
from tierstore import CopyState, CorruptFileError, StoreConfig, StoreIOError, TensorKey, TensorMeta, TierStore
from tierstore.nvme import HEADER_NBYTES, IO_ALIGNMENT, SUFFIX, NVMeDirectory

S = CopyState


def swap_path(directory: Path, key: str) -> Path:
    return directory / f"{TensorKey(key).file_stem()}{SUFFIX}"


def usage(store: TierStore) -> dict[str, int]:
    return {tier: u["used_nbytes"] for tier, u in store.usage().items()}


@pytest.fixture
def small_fs(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A 2 MiB tmpfs, unmounted when the test ends."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {result.stderr.strip() or result.returncode}")

    def unmount() -> None:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)

    request.addfinalizer(unmount)
    return mount_point


def free_nbytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.fixture
def device_str(device: torch.device) -> str:
    return str(device)


# ---- full file system --------------------------------------------------------------------------------------
@pytest.mark.parametrize("filled_by", ["store", "other_file"])
def test_full_file_system(small_fs: Path, device_str: str, filled_by: str) -> None:
    config = StoreConfig(device=device_str, host_budget_nbytes=8 << 20, nvme_path=str(small_fs), nvme_budget_nbytes=1 << 30)
    with TierStore(config) as store:
        kept = random_tensor(torch.float32, 196_613, seed=1)  # ~768 KiB, an odd size
        store.register("kept", TensorMeta.of(kept), "nvme", init=kept)
        if filled_by == "other_file":
            (small_fs / "filler").write_bytes(b"\0" * (free_nbytes(small_fs) - 256 * 1024))
        free = free_nbytes(small_fs)
        big = TensorMeta(torch.uint8, free + IO_ALIGNMENT)  # under the budget, over the disk
        before, files = usage(store), sorted(os.listdir(small_fs))

        with pytest.raises(StoreIOError) as info:
            store.register("big/one", big, "nvme")
        exc = info.value
        assert exc.errno == errno.ENOSPC and exc.errno_name == "ENOSPC"
        assert str(swap_path(small_fs, "big/one")) in str(exc) and exc.path == str(swap_path(small_fs, "big/one"))
        assert "disk full" in str(exc)

        # Nothing half-done: no file, no bytes accounted, no record, space given back.
        assert sorted(os.listdir(small_fs)) == files and usage(store) == before
        assert TensorKey("big/one") not in store.keys() and free_nbytes(small_fs) == free

        # What the store held still reads back bit-exact, and a smaller allocation still works.
        store.fetch("kept", "gpu").wait()
        assert torch.equal(as_bytes(store.tensor("kept", "gpu")), as_bytes(kept))
        small = random_tensor(torch.int64, 16_001, seed=2)
        store.register("small", TensorMeta.of(small), "nvme", init=small)
        store.fetch("small", "host").wait()
        assert torch.equal(as_bytes(store.tensor("small", "host")), as_bytes(small))


def test_full_file_system_directory_level(small_fs: Path) -> None:
    directory = NVMeDirectory(small_fs, 1 << 30)
    try:
        meta = TensorMeta(torch.float32, free_nbytes(small_fs) // 4 + 1)
        with pytest.raises(StoreIOError) as info:
            directory.create(TensorKey("huge"), meta)
        assert info.value.errno == errno.ENOSPC and str(small_fs / f"huge{SUFFIX}") in str(info.value)
        assert directory.used_nbytes == 0 and not (small_fs / f"huge{SUFFIX}").exists()
        directory.create(TensorKey("fits"), TensorMeta(torch.float32, 1000))
    finally:
        directory.close()


# ---- a write that fails mid-way ----------------------------------------------------------------------------
def test_write_error_mid_way_keeps_the_dirty_copy(nvme_dir: Path, device_str: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device fails (EIO) on the second block of a write back home: the error names file and offset, the
    home copy is marked stale, the host copy stays current with the new value, and a retry succeeds."""
    config = StoreConfig(device=device_str, host_budget_nbytes=1 << 20, nvme_path=str(nvme_dir), io_block_nbytes=IO_ALIGNMENT)
    with TierStore(config) as store:
        old, new = random_tensor(torch.float32, 5000, 3), random_tensor(torch.float32, 5000, 4)
        store.register("w", TensorMeta.of(old), "nvme", init=old)
        store.fetch("w", "host").wait()
        store.tensor("w", "host").copy_(new)
        store.mark_dirty("w", "host")
        swap = store.record("w").copies[store.record("w").home].allocation.swap
        fds = {swap.fd_buffered, swap.fd_direct} - {None}
        real_pwrite = os.pwrite
        failing_offset = HEADER_NBYTES + IO_ALIGNMENT

        def pwrite(fd: int, data, offset: int) -> int:
            if fd in fds and offset >= failing_offset:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", pwrite)
        before = usage(store)
        with pytest.raises(StoreIOError) as info:
            store.evict("w", "host").wait()
        exc = info.value
        assert exc.errno == errno.EIO and exc.path == str(swap.path) and exc.offset == failing_offset
        assert str(swap.path) in str(exc) and f"offset {failing_offset}" in str(exc)
        assert (store.state("w", "host"), store.state("w", "nvme")) == (S.DIRTY, S.STALE)
        assert usage(store) == before
        assert torch.equal(as_bytes(store.tensor("w", "host")), as_bytes(new))
        with pytest.raises(RuntimeError, match="only current copy"):
            store.release("w", "host")

        monkeypatch.setattr(os, "pwrite", real_pwrite)  # the device recovers
        store.evict("w", "host").wait()
        assert (store.state("w", "host"), store.state("w", "nvme")) == (S.ABSENT, S.CLEAN)
        store.fetch("w", "host").wait()
        assert torch.equal(as_bytes(store.tensor("w", "host")), as_bytes(new))


# ---- a damaged file under a live store ---------------------------------------------------------------------
def test_truncated_file_fails_the_fetch_and_nothing_else(nvme_dir: Path, device_str: str) -> None:
    config = StoreConfig(device=device_str, host_budget_nbytes=1 << 20, nvme_path=str(nvme_dir))
    with TierStore(config) as store:
        a, b = random_tensor(torch.float16, 20_001, 5), random_tensor(torch.float16, 3000, 6)
        store.register("a", TensorMeta.of(a), "nvme", init=a)
        store.register("b", TensorMeta.of(b), "nvme", init=b)
        before = usage(store)
        path = swap_path(nvme_dir, "a")
        cut = HEADER_NBYTES + 3 * IO_ALIGNMENT + 17
        os.truncate(path, cut)
        with pytest.raises(StoreIOError) as info:
            store.fetch("a", "gpu").wait()
        assert info.value.path == str(path) and info.value.offset == cut
        assert str(path) in str(info.value) and f"offset {cut}" in str(info.value)
        assert (store.state("a", "gpu"), store.state("a", "host")) == (S.ABSENT, S.ABSENT)
        assert usage(store) == before  # the staging and gpu reservations were returned
        store.fetch("b", "gpu").wait()
        assert torch.equal(as_bytes(store.tensor("b", "gpu")), as_bytes(b))


@pytest.mark.parametrize("offset", ["header", "payload"])
def test_corrupted_file_fails_the_fetch(nvme_dir: Path, device_str: str, offset: str) -> None:
    config = StoreConfig(device=device_str, host_budget_nbytes=1 << 20, nvme_path=str(nvme_dir))
    with TierStore(config) as store:
        data = random_tensor(torch.int64, 999, 7)
        store.register("c/d", TensorMeta.of(data), "nvme", init=data)
        path = swap_path(nvme_dir, "c/d")
        where = 20 if offset == "header" else HEADER_NBYTES + 4000
        with open(path, "r+b") as f:
            f.seek(where)
            byte = f.read(1)
            f.seek(where)
            f.write(bytes([byte[0] ^ 0x01]))
        before = usage(store)
        with pytest.raises(CorruptFileError) as info:
            store.fetch("c/d", "gpu").wait()
        assert info.value.path == str(path) and str(path) in str(info.value)
        assert usage(store) == before and store.state("c/d", "gpu") is S.ABSENT


def test_staging_read_that_fails_at_once(nvme_dir: Path, device_str: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The staging read of a fetch to the GPU fails before the store has even queued the GPU copy (a corrupt
    header is seen at once): the fetch must hand back that error, not trip over the freed staging copy."""
    config = StoreConfig(device=device_str, host_budget_nbytes=1 << 20, nvme_path=str(nvme_dir))
    with TierStore(config) as store:
        store.register("e", TensorMeta(torch.float32, 100), "nvme", init=torch.ones(100))
        with open(swap_path(nvme_dir, "e"), "r+b") as f:
            f.write(b"NOTMAGIC")
        real_read = store.engine.read

        def read_completing_at_once(*args, **kwargs):
            handle = real_read(*args, **kwargs)
            handle._wait_complete()  # as if the IO worker finished before the caller went on
            return handle

        monkeypatch.setattr(store.engine, "read", read_completing_at_once)
        before = usage(store)
        with pytest.raises(CorruptFileError, match="magic"):
            store.fetch("e", "gpu").wait()
        assert (store.state("e", "gpu"), store.state("e", "host")) == (S.ABSENT, S.ABSENT)
        assert usage(store) == before
