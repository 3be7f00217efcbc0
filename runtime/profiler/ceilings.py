"""Bandwidth ceilings: what each path can reach on this machine, in GB/s (1e9 bytes).

- :func:`measure_ceilings` for the profiler: PCIe each way (a pinned copy of ``PCIE_PROBE_NBYTES``, timed by CUDA
  events after a warm-up, best of several), and the disk of the store's NVMe directory through
  :func:`disk_ceiling_gbps`. On a CPU-only machine the "device" copies are memory copies, whose speed depends on
  their size: a copy of a block that fits the CPU's caches runs several times faster than one of 256 MiB through
  DRAM (issue 41: a CPU run's GPU -> pinned path read 6.93 GB/s against a 1.66 GB/s ceiling, the store copying
  3 MiB blocks and the probe 256 MiB on a busy 2-core machine). And a copy torch splits over the cores waits for
  the slowest of them: on that machine, with other processes running, a 3 MiB copy on two threads took 20 ms
  (0.2 GB/s) where one thread copied it at 58 GB/s. There the probe copies as much as the store's largest entry
  (:func:`copy_probe_nbytes`, what one store copy moves at most), on one thread and on torch's threads (the
  store's copies run on the latter), and keeps the best of ``CPU_PROBE_REPEATS`` copies of either
  (:func:`cpu_copy_ceilings_gbps`).
- :func:`disk_ceiling_gbps`: the disk as fio with a queue depth measures it -- several aligned IOs in flight
  at once, not one stream as ``dd`` runs. A drive (or a virtio disk) serves parallel IOs faster than one, and
  the store keeps ``io_threads`` of them in flight; a single-stream ceiling let the store's rate read above
  100% of it.
- :func:`ceilings_from_store_bench`: the raw ceilings of a ``tierstore bench store --json`` result.

What this leaves out: the two PCIe directions at once (each path's share is against its own direction) and
random IO (the store reads and writes whole swap files in large aligned pieces).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import stat
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.config.units import format_size
from runtime.update.rates import pinned_copy_gbps
from tierstore import CopyState, TierStore, create_new

log = logging.getLogger(__name__)

STORE_BENCH_PATHS = {"host->gpu": "h2d", "gpu->host": "d2h", "nvme->host": "read", "host->nvme": "write"}
# A copy this long (about 5 ms at 55 GB/s) dwarfs launch and sync overheads, and the warm-up copies bring the
# link and clocks out of their idle state first; 32 MiB once each way was at the mercy of both.
PCIE_PROBE_NBYTES = 256 << 20
WARMUP_COPIES = 2
IO_ALIGNMENT = 4096  # O_DIRECT wants buffers, offsets and sizes aligned to the logical block; 4 KiB covers it
PROBE_FILE = "probe"
IDLE_TIMEOUT_S = 120.0  # a step's NVMe write-backs of a large model take tens of seconds on a slow disk
IDLE_POLL_S = 0.01
CPU_PROBE_REPEATS = 20  # copies of a block on the CPU: microseconds each, so many repeats cost nothing


def ceilings_from_store_bench(results: str | os.PathLike[str] | Mapping[str, Any] | Iterable[Any]) -> dict[str, float]:
    """Raw ceilings (GB/s) from ``tierstore bench store`` results: a JSON file's path, its parsed content,
    or a list of ``PathResult``."""
    parsed = json.loads(Path(results).read_text()) if isinstance(results, (str, os.PathLike)) else results
    rows = parsed.get("results", []) if isinstance(parsed, Mapping) else list(parsed)
    out: dict[str, float] = {}
    for row in rows:
        row = row if isinstance(row, Mapping) else row.as_dict()
        kind = STORE_BENCH_PATHS.get(str(row.get("path")))
        if kind is not None:
            out[kind] = float(row["raw_gbps"])
    return out


def measure_ceilings(store: TierStore, nbytes: int | None = None, repeats: int = 5, *,
                     disk_nbytes: int = 1 << 30, disk_ios_in_flight: int = 8) -> dict[str, float]:
    """The ceiling of each path the profiler reports: "h2d" / "d2h" (a copy of ``nbytes`` between pinned
    memory and the device; None: ``PCIE_PROBE_NBYTES`` on a GPU, on the CPU a host copy of
    :func:`copy_probe_nbytes`, the best of at least ``CPU_PROBE_REPEATS``: see the module doc) and, when the
    store has an NVMe tier, "read" / "write" (:func:`measure_disk_ceiling` on its directory,
    ``disk_ios_in_flight`` IOs in flight, the store's IO mode preferred). Moves nothing through the store, and
    first waits for the store's copies in flight (:func:`wait_for_idle_store`). A disk probe that fails (a full
    disk) is logged and leaves those two paths without a ceiling, so a profile still runs."""
    device = store.device
    wait_for_idle_store(store)
    if nbytes is None and device.type != "cuda":
        nbytes, repeats = copy_probe_nbytes(store), max(repeats, CPU_PROBE_REPEATS)
    nbytes = nbytes or PCIE_PROBE_NBYTES
    probe = pcie_ceilings_gbps if device.type == "cuda" else cpu_copy_ceilings_gbps
    out = dict(zip(("h2d", "d2h"), probe(device, nbytes, repeats), strict=True))
    nvme = store.tiers.nvme
    if nvme is not None:
        directory = nvme.directory
        try:
            disk = measure_disk_ceiling(Path(directory.path), ios_in_flight=disk_ios_in_flight,
                                        total_nbytes=disk_nbytes, repeats=max(2, min(repeats, 3)),
                                        direct=directory.io_mode == "direct")
        except OSError as exc:
            log.warning("disk ceiling of %s not measured (%s): the NVMe paths are reported without one", directory.path, exc)
        else:
            out["read"], out["write"] = disk.read_gbps, disk.write_gbps
    log.info("bandwidth ceilings (GB/s; device copies of %s, best of %d): %s", format_size(nbytes), repeats,
             ", ".join(f"{k} {v:.2f}" for k, v in out.items()))
    return out


def copy_probe_nbytes(store: TierStore) -> int:
    """Bytes of the CPU's copy probe: the store's largest entry (a block's fp32 state: one copy to or from the
    device moves at most that, a fetch from the master at most ``PCIE_PROBE_NBYTES`` a piece), at least a page
    and at most ``PCIE_PROBE_NBYTES``; that cap for a store holding nothing yet."""
    largest = max((store.record(key).meta.nbytes for key in store.keys()), default=PCIE_PROBE_NBYTES)
    return min(PCIE_PROBE_NBYTES, max(IO_ALIGNMENT, largest))


def wait_for_idle_store(store: TierStore, timeout_s: float = IDLE_TIMEOUT_S) -> bool:
    """Wait until no copy of the store is on its way (no copy LOADING on any tier), so a probe does not share
    the link or the disk with the store's own traffic: write-backs still landing after a step made the disk
    probe of a moments-on-NVMe run read a third of the disk's speed. Returns False (logged) at the timeout."""
    store.engine.synchronize()  # device copies done but not yet observed would stay LOADING
    deadline = time.monotonic() + timeout_s
    while True:
        busy = sum(1 for key in store.keys() for tier in store.tiers if store.state(key, tier) is CopyState.LOADING)
        if not busy:
            return True
        if time.monotonic() > deadline:
            log.warning("%d copies still on their way after %.0f s: the ceilings measured now share the links with "
                        "them and may read low", busy, timeout_s)
            return False
        time.sleep(IDLE_POLL_S)


# ---- PCIe -----------------------------------------------------------------------------------------------
def pcie_ceilings_gbps(device: torch.device, nbytes: int = PCIE_PROBE_NBYTES, repeats: int = 5) -> tuple[float, float]:
    """(H2D, D2H) GB/s of one plain copy of ``nbytes`` between pinned memory and ``device``, each the best of
    ``repeats`` after ``WARMUP_COPIES`` (``runtime.update.rates.pinned_copy_gbps``)."""
    return pinned_copy_gbps(device, nbytes, repeats, warmups=WARMUP_COPIES)


def cpu_copy_ceilings_gbps(device: torch.device, nbytes: int, repeats: int) -> tuple[float, float]:
    """(to the device, from it) GB/s of a memory copy of ``nbytes`` on a CPU-only machine: each the best of
    :func:`pcie_ceilings_gbps` on torch's intra-op threads and on one thread (see the module doc; the thread count
    is restored after, and the store is idle while the profiler probes)."""
    threads = torch.get_num_threads()
    best = pcie_ceilings_gbps(device, nbytes, repeats)
    if threads > 1:
        torch.set_num_threads(1)
        try:
            single = pcie_ceilings_gbps(device, nbytes, repeats)
        finally:
            torch.set_num_threads(threads)
        best = (max(best[0], single[0]), max(best[1], single[1]))
    return best


# ---- disk -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiskCeiling:
    """A disk ceiling: aggregate GB/s each way, the IO mode it used, and what it moved per pass."""

    read_gbps: float
    write_gbps: float
    io_mode: str  # "direct" (O_DIRECT) or "buffered" (the file system refused O_DIRECT)
    ios_in_flight: int
    block_nbytes: int
    nbytes: int  # bytes per pass (a multiple of block_nbytes)

    @property
    def io_mode_name(self) -> str:
        """``O_DIRECT`` or ``buffered``, for a person."""
        return "O_DIRECT" if self.io_mode == "direct" else "buffered"

    def describe(self) -> str:
        """How it was measured, for a table's method column."""
        return f"{self.ios_in_flight} x {format_size(self.block_nbytes)} in flight, {self.io_mode_name}, writes fsync'd"


def disk_ceiling_gbps(directory: str | os.PathLike[str], ios_in_flight: int = 8, block_nbytes: int = 8 << 20,
                      total_nbytes: int = 1 << 30, repeats: int = 2) -> tuple[float, float]:
    """(read GB/s, write GB/s) of the disk holding ``directory``, with ``ios_in_flight`` aligned IOs of
    ``block_nbytes`` in flight, as fio with that queue depth measures it: see :func:`measure_disk_ceiling`."""
    ceiling = measure_disk_ceiling(directory, ios_in_flight=ios_in_flight, block_nbytes=block_nbytes,
                                   total_nbytes=total_nbytes, repeats=repeats)
    return ceiling.read_gbps, ceiling.write_gbps


def measure_disk_ceiling(directory: str | os.PathLike[str], *, ios_in_flight: int = 8, block_nbytes: int = 8 << 20,
                         total_nbytes: int = 1 << 30, repeats: int = 2, direct: bool = True) -> DiskCeiling:
    """Aggregate write then read bandwidth of one file of ``total_nbytes`` in ``directory``.

    ``ios_in_flight`` threads each own an aligned buffer of ``block_nbytes`` and the blocks at disjoint
    offsets ``i * block`` with ``i % ios_in_flight`` their own; a write pass is every thread's pwrites then
    one fsync, a read pass every thread's preads (a total under ``ios_in_flight`` blocks is cut into smaller
    blocks, aligned, so as many IOs stay in flight). Each figure is the best of ``repeats`` passes: total bytes
    over the wall time of the pass. The file is preallocated, as the store's swap files are. IO is O_DIRECT
    when ``direct`` and the file system takes it; otherwise buffered (logged), with the file's pages
    dropped from the page cache before each read pass (on tmpfs there is nothing else to read from).

    The file lives in a private 0700 subdirectory created for it (a fresh random name) and is created new
    with ``O_EXCL|O_NOFOLLOW``, and never reopened by name: no link planted in ``directory`` is followed.
    The subdirectory goes afterwards."""
    if ios_in_flight < 1 or repeats < 1:
        raise ValueError(f"ios_in_flight and repeats must be >= 1, got {ios_in_flight} and {repeats}")
    if block_nbytes < IO_ALIGNMENT or block_nbytes % IO_ALIGNMENT:
        raise ValueError(f"block_nbytes must be a positive multiple of {IO_ALIGNMENT} (O_DIRECT alignment), got {block_nbytes}")
    # A total too small for ios_in_flight blocks gets smaller blocks rather than fewer IOs in flight.
    block = min(block_nbytes, max(IO_ALIGNMENT, total_nbytes // ios_in_flight // IO_ALIGNMENT * IO_ALIGNMENT))
    num_blocks = max(1, total_nbytes // block)
    workers = min(ios_in_flight, num_blocks)
    nbytes = num_blocks * block
    buffers = [mmap.mmap(-1, block) for _ in range(workers)]  # page-aligned, as O_DIRECT wants
    pattern = os.urandom(block)  # not zeros: a backend that compresses or skips zero blocks would flatter itself
    for buf in buffers:
        buf.write(pattern)
    try:
        with _private_file(Path(directory)) as fd:
            io_mode = "direct" if direct and _try_direct_io(fd, buffers[0]) else "buffered"
            if direct and io_mode == "buffered":
                log.info("disk ceiling in %s: the file system refuses O_DIRECT; measuring buffered IO (page cache "
                         "dropped before reads)", directory)
            _preallocate(fd, nbytes)
            offsets = [[i * block for i in range(w, num_blocks, workers)] for w in range(workers)]

            def run_pass(write: bool) -> float:
                if not write and io_mode == "buffered" and hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)  # a page-cache hit is not the disk
                start = time.perf_counter()
                _run_streams(fd, buffers, offsets, write)
                if write:
                    os.fsync(fd)
                return time.perf_counter() - start

            write_s = min(run_pass(True) for _ in range(repeats))
            read_s = min(run_pass(False) for _ in range(repeats))
    finally:
        for buf in buffers:
            buf.close()
    ceiling = DiskCeiling(nbytes / read_s / 1e9, nbytes / write_s / 1e9, io_mode, workers, block, nbytes)
    log.info("disk ceiling in %s (%s): read %.2f GB/s, write %.2f GB/s", directory, ceiling.describe(),
             ceiling.read_gbps, ceiling.write_gbps)
    return ceiling


def _run_streams(fd: int, buffers: list[mmap.mmap], offsets: list[list[int]], write: bool) -> None:
    """One thread per stream, all started before any is joined. (A thread pool would hand a second stream
    to a worker whose first one finished early, running two streams one after the other: fewer IOs in flight
    than asked.) The first error of any stream is raised once all have stopped."""
    errors: list[BaseException] = []

    def stream(buf: mmap.mmap, mine: list[int]) -> None:
        try:
            _io_worker(fd, buf, mine, write)
        except BaseException as exc:  # raised in the caller's thread below
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(buf, mine), name=f"tierstore-ceiling-{i}", daemon=True)
               for i, (buf, mine) in enumerate(zip(buffers, offsets, strict=True))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _io_worker(fd: int, buf: mmap.mmap, offsets: list[int], write: bool) -> None:
    """One in-flight stream: pwrite or pread ``buf`` at each offset, checking every byte count."""
    for offset in offsets:
        moved = os.pwrite(fd, buf, offset) if write else os.preadv(fd, [buf], offset)
        if moved != len(buf):
            raise RuntimeError(f"disk ceiling probe: {'wrote' if write else 'read'} {moved} of {len(buf)} bytes at {offset}")


@contextmanager
def _private_file(directory: Path) -> Iterator[int]:
    """A new file in a new private subdirectory of ``directory``; yields its descriptor, removes both after."""
    private = tempfile.mkdtemp(prefix=".tierstore-ceiling-", dir=directory)  # mode 0700, a fresh random name
    dir_fd = os.open(private, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(dir_fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise RuntimeError(f"{private} changed hands after it was created (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
        fd = create_new(PROBE_FILE, dir_fd=dir_fd)  # O_EXCL|O_NOFOLLOW, 0600
        try:
            yield fd
        finally:
            os.close(fd)
            os.unlink(PROBE_FILE, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
        os.rmdir(private)


def _try_direct_io(fd: int, buf: mmap.mmap) -> bool:
    """Switch fd to O_DIRECT (never reopening it by name) and check one aligned write; on refusal (EINVAL
    from tmpfs on older kernels, and some network file systems) leave it buffered and return False."""
    if not hasattr(os, "O_DIRECT"):
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
        return os.pwrite(fd, memoryview(buf)[:IO_ALIGNMENT], 0) == IO_ALIGNMENT
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return False


def _preallocate(fd: int, nbytes: int) -> None:
    """Reserve the file's blocks first, as the store does for swap files, so no pass pays for allocation."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise  # ENOSPC and real IO errors
