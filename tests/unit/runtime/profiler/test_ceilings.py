"""Bandwidth ceilings: the disk probe keeps several aligned IOs in flight at disjoint offsets of a private file,
falls back to buffered IO where O_DIRECT is refused, never follows a planted link, and cleans up; the PCIe
probe gives way to a full GPU."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.profiler import ceilings
from runtime.profiler.ceilings import IO_ALIGNMENT, disk_ceiling_gbps, measure_ceilings, measure_disk_ceiling, pcie_ceilings_gbps
from runtime.update import rates
from tierstore import StoreConfig, TensorMeta, TierStore

BLOCK = 64 << 10


class IOLog:
    """Wraps os.pwrite / os.preadv: records each block-sized IO and how many were in flight at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, block: int, barrier: threading.Barrier | None = None):
        self.block = block
        self.barrier = barrier
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.writes: list[int] = []
        self.reads: list[int] = []
        self.threads: set[str] = set()
        self.paths: set[str] = set()
        self.direct_flags: set[bool] = set()
        real_pwrite, real_preadv = os.pwrite, os.preadv
        monkeypatch.setattr(os, "pwrite", lambda fd, buf, offset: self._io(fd, len(buf), offset, self.writes,
                                                                           lambda: real_pwrite(fd, buf, offset)))
        monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: self._io(fd, sum(len(b) for b in bufs), offset,
                                                                            self.reads, lambda: real_preadv(fd, bufs, offset)))

    def _io(self, fd: int, nbytes: int, offset: int, record: list[int], run: Any) -> int:
        if nbytes != self.block:  # the one 4 KiB write that tries O_DIRECT
            return run()
        with self.lock:
            record.append(offset)
            self.threads.add(threading.current_thread().name)
            self.paths.add(os.readlink(f"/proc/self/fd/{fd}"))
            self.direct_flags.add(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0)))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.barrier is not None and len(record) <= self.barrier.parties:
                self.barrier.wait()  # breaks (and the probe raises) unless this many IOs are in flight together
            return run()
        finally:
            with self.lock:
                self.in_flight -= 1


def test_disk_ceiling_keeps_ios_in_flight_at_disjoint_aligned_offsets(tmpfs_dir, monkeypatch):
    ios, num_blocks = 4, 16
    io = IOLog(monkeypatch, BLOCK, threading.Barrier(4, timeout=10))
    ceiling = measure_disk_ceiling(tmpfs_dir, ios_in_flight=ios, block_nbytes=BLOCK, total_nbytes=num_blocks * BLOCK,
                                   repeats=2)
    assert io.max_in_flight == ios and len(io.threads) == ios
    expected = sorted(i * BLOCK for i in range(num_blocks)) * 2  # every block once per pass, two passes
    assert sorted(io.writes) == sorted(expected) and sorted(io.reads) == sorted(expected)
    assert all(offset % IO_ALIGNMENT == 0 for offset in io.writes + io.reads)
    assert ceiling.nbytes == num_blocks * BLOCK and ceiling.ios_in_flight == ios and ceiling.block_nbytes == BLOCK
    assert ceiling.read_gbps > 0 and ceiling.write_gbps > 0
    # One file, in a private 0700 subdirectory of the directory, mode 0600; all gone afterwards.
    (path,) = io.paths
    assert Path(path).parent.parent == tmpfs_dir.resolve() and Path(path).parent.name.startswith(".tierstore-ceiling-")
    assert list(tmpfs_dir.iterdir()) == []
    assert io.direct_flags == {ceiling.io_mode == "direct"}


def test_disk_ceiling_falls_back_to_buffered_where_o_direct_is_refused(tmpfs_dir, monkeypatch, caplog):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    real_fcntl = fcntl.fcntl

    def refusing(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # what tmpfs says on kernels without O_DIRECT there
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", refusing)
    io = IOLog(monkeypatch, BLOCK)
    with caplog.at_level(logging.INFO, logger="runtime.profiler.ceilings"):
        ceiling = measure_disk_ceiling(tmpfs_dir, ios_in_flight=2, block_nbytes=BLOCK, total_nbytes=4 * BLOCK, repeats=1)
    assert ceiling.io_mode == "buffered" and io.direct_flags == {False}
    assert any("refuses O_DIRECT" in r.getMessage() for r in caplog.records)
    assert ceiling.read_gbps > 0 and ceiling.write_gbps > 0


def test_disk_ceiling_is_parallel_by_default_and_returns_read_then_write(tmpfs_dir, monkeypatch):
    io = IOLog(monkeypatch, 1 << 20)
    read_gbps, write_gbps = disk_ceiling_gbps(tmpfs_dir, block_nbytes=1 << 20, total_nbytes=16 << 20)
    assert len(io.threads) == 8 and read_gbps > 0 and write_gbps > 0
    assert len(io.writes) == len(io.reads) == 2 * 16  # two passes each way by default


def test_disk_ceiling_never_follows_a_planted_link(nvme_dir, tmp_path_factory):
    victim = tmp_path_factory.mktemp("victims") / "victim"
    victim.write_bytes(b"someone else's file\n")
    for name in ("probe", ".tierstore-ceiling-probe"):
        (nvme_dir / name).symlink_to(victim)
    assert all(v > 0 for v in disk_ceiling_gbps(nvme_dir, ios_in_flight=2, block_nbytes=BLOCK, total_nbytes=4 * BLOCK, repeats=1))
    assert victim.read_bytes() == b"someone else's file\n"
    assert sorted(p.name for p in nvme_dir.iterdir()) == [".tierstore-ceiling-probe", "probe"]


def test_disk_ceiling_cleans_up_after_a_failed_write(tmpfs_dir, monkeypatch):
    real_pwrite = os.pwrite

    def full(fd: int, buf: Any, offset: int) -> int:
        if offset >= 2 * BLOCK:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space"):
        measure_disk_ceiling(tmpfs_dir, ios_in_flight=2, block_nbytes=BLOCK, total_nbytes=8 * BLOCK, repeats=1)
    assert list(tmpfs_dir.iterdir()) == []


def test_disk_ceiling_checks_its_arguments(tmpfs_dir):
    with pytest.raises(ValueError, match="multiple of 4096"):
        measure_disk_ceiling(tmpfs_dir, block_nbytes=5000)
    with pytest.raises(ValueError, match="ios_in_flight"):
        measure_disk_ceiling(tmpfs_dir, ios_in_flight=0)


def test_private_directory_is_owner_only(tmpfs_dir, monkeypatch):
    modes: list[int] = []
    real = ceilings.create_new

    def spy(name: str, *, dir_fd: int) -> int:
        modes.append(stat.S_IMODE(os.fstat(dir_fd).st_mode))
        fd = real(name, dir_fd=dir_fd)
        modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return fd

    monkeypatch.setattr(ceilings, "create_new", spy)
    measure_disk_ceiling(tmpfs_dir, ios_in_flight=1, block_nbytes=BLOCK, total_nbytes=BLOCK, repeats=1)
    assert modes == [0o700, 0o600]


def test_measure_ceilings_goes_on_without_a_disk_ceiling(tmpfs_dir, monkeypatch, caplog):
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ceilings, "measure_disk_ceiling", failing)
    with TierStore(StoreConfig(nvme_path=str(tmpfs_dir), host_budget_nbytes=1 << 20)) as store:
        with caplog.at_level(logging.WARNING, logger="runtime.profiler.ceilings"):
            out = measure_ceilings(store, nbytes=1 << 20, repeats=1)
    assert set(out) == {"h2d", "d2h"} and "disk ceiling" in caplog.text


def test_pcie_probe_halves_its_buffer_when_the_device_is_full(monkeypatch):
    real_empty = torch.empty
    asked: list[int] = []
    room = [64 << 20]

    def empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            asked.append(size[0])
            if size[0] > room[0]:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with rates._probe_buffers(torch.device("cpu"), 256 << 20, False) as (host, target):
        assert host.numel() == target.numel() == 64 << 20 and asked == [256 << 20, 128 << 20, 64 << 20]
    room[0] = 0  # not even the smallest probe fits: the error is the caller's to see
    asked.clear()
    with pytest.raises(torch.OutOfMemoryError):
        with rates._probe_buffers(torch.device("cpu"), 256 << 20, False):
            pass
    assert asked == [256 << 20, 128 << 20, 64 << 20, 32 << 20]


def test_pcie_probe_measures_both_directions():
    h2d, d2h = pcie_ceilings_gbps(torch.device("cpu"), 1 << 20, repeats=2)
    assert h2d > 0 and d2h > 0
    with pytest.raises(ValueError):
        pcie_ceilings_gbps(torch.device("cpu"), 1 << 20, repeats=0)


def test_measure_ceilings_waits_for_the_store_copies_in_flight(tmpfs_dir, monkeypatch):
    """A write-back still landing would share the disk with the probe: the probe starts after it."""
    import time

    import tierstore.nvme

    real_write = tierstore.nvme.NVMeDirectory.write

    def slow_write(self: Any, *args: Any, **kwargs: Any) -> int:
        time.sleep(0.3)  # a write-back still landing when the probe is asked for: the probe must wait for it
        return real_write(self, *args, **kwargs)

    seen: list[tuple[str, bool]] = []

    def probe(*args: Any, **kwargs: Any) -> Any:
        seen.append((store.state("k", "nvme").value, handle.done()))
        return ceilings.DiskCeiling(1.0, 1.0, "direct", 1, BLOCK, BLOCK)

    monkeypatch.setattr(tierstore.nvme.NVMeDirectory, "write", slow_write)
    monkeypatch.setattr(ceilings, "measure_disk_ceiling", probe)
    with TierStore(StoreConfig(nvme_path=str(tmpfs_dir), host_budget_nbytes=1 << 20)) as store:
        store.register("k", TensorMeta(torch.uint8, BLOCK), "host", init=torch.zeros(BLOCK, dtype=torch.uint8))
        store.mark_dirty("k", "host")
        handle = store.evict("k", "host", "nvme", release=False)
        assert store.state("k", "nvme").value == "loading"
        measure_ceilings(store, nbytes=1 << 20, repeats=1)
        assert len(seen) == 1 and seen[0][0] != "loading" and seen[0][1]
