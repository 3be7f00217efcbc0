"""``tierstore bench store``: the store's bandwidth on each path beside the raw ceiling measured in the same run.

Paths: host->GPU and GPU->host (raw ceiling: a plain pinned ``copy_`` on one stream), NVMe->host and
host->NVMe (raw ceiling: :func:`runtime.profiler.ceilings.measure_disk_ceiling` on the same directory, several
aligned IOs in flight as fio with a queue depth runs them, O_DIRECT where the file system takes it). Each path
moves ``total_nbytes`` in ``transfer_nbytes`` pieces, all issued before the first wait, so the store may keep
as many in flight as its queues allow. ``dd`` (one stream) is measured beside it for reference only: the
store keeps several IOs in flight, so a single-stream ceiling would let it read above 100%.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from runtime.bench import synchronize
from runtime.profiler.ceilings import measure_disk_ceiling
from tierstore import StoreConfig, TensorMeta, TierName, TierStore

log = logging.getLogger(__name__)


@dataclass
class PathResult:
    """One path's measurement: bytes moved, store seconds and raw-ceiling seconds."""

    path: str
    nbytes: int
    store_s: float
    raw_s: float
    raw_method: str

    @property
    def store_gbps(self) -> float:
        """Store bandwidth in GB/s (1e9 bytes)."""
        return self.nbytes / self.store_s / 1e9

    @property
    def raw_gbps(self) -> float:
        """Raw ceiling in GB/s."""
        return self.nbytes / self.raw_s / 1e9

    @property
    def ratio(self) -> float:
        """Store bandwidth over the raw ceiling."""
        return self.raw_s / self.store_s

    def as_dict(self) -> dict[str, object]:
        """JSON-ready figures."""
        return {**asdict(self), "store_gbps": self.store_gbps, "raw_gbps": self.raw_gbps, "ratio": self.ratio}


def _best_of(repeats: int, run: Callable[[], float]) -> float:
    """The fastest of ``repeats`` timed runs (after the first, a warm-up): the ceiling each side can reach."""
    run()
    return min(run() for _ in range(repeats))


def _register_random(store: TierStore, prefix: str, num: int, nbytes: int, home: TierName) -> list[str]:
    """num keys of nbytes random bytes with their home on ``home``."""
    keys = [f"{prefix}.{i}" for i in range(num)]
    for key in keys:
        store.register(key, TensorMeta(torch.uint8, nbytes), home, init=torch.randint(0, 255, (nbytes,), dtype=torch.uint8))
    return keys


def _time_fetch(store: TierStore, keys: list[str], to: TierName) -> float:
    """Drop every copy on ``to``, then time fetching all keys there (all issued before the first wait)."""
    for key in keys:
        if store.state(key, to).value != "absent":
            store.release(key, to)
    synchronize(store.device)
    start = time.perf_counter()
    for handle in [store.fetch(key, to) for key in keys]:
        handle.wait()
    return time.perf_counter() - start


def _time_writeback(store: TierStore, keys: list[str], frm: TierName, to: TierName) -> float:
    """Make every key's copy on ``frm`` dirty, then time writing all of them back to ``to``."""
    for key in keys:
        store.fetch(key, frm).wait()
        store.mark_dirty(key, frm)
    synchronize(store.device)
    start = time.perf_counter()
    for handle in [store.evict(key, frm, to, release=False) for key in keys]:
        handle.wait()
    return time.perf_counter() - start


def bench_pcie(store: TierStore, num_transfers: int, transfer_nbytes: int, repeats: int) -> list[PathResult]:
    """host->GPU and GPU->host through the store, and a raw pinned copy_ of the same bytes."""
    device = store.device
    keys = _register_random(store, "bench.pcie", num_transfers, transfer_nbytes, TierName.HOST)
    h2d_s = _best_of(repeats, lambda: _time_fetch(store, keys, TierName.GPU))
    d2h_s = _best_of(repeats, lambda: _time_writeback(store, keys, TierName.GPU, TierName.HOST))
    # Raw ceiling: the same host buffers, one plain copy_ each, on one side stream.
    hosts = [store.tensor(key, TierName.HOST) for key in keys]
    gpus = [torch.empty(transfer_nbytes, dtype=torch.uint8, device=device) for _ in keys]
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def raw(to_device: bool) -> float:
        synchronize(device)
        start = time.perf_counter()
        with torch.cuda.stream(stream) if stream is not None else _null():
            for host, gpu in zip(hosts, gpus, strict=True):
                (gpu.copy_(host, non_blocking=True) if to_device else host.copy_(gpu, non_blocking=True))
        synchronize(device)
        return time.perf_counter() - start

    raw_h2d_s = _best_of(repeats, lambda: raw(True))
    raw_d2h_s = _best_of(repeats, lambda: raw(False))
    for key in keys:
        store.unregister(key)
    total = num_transfers * transfer_nbytes
    method = "pinned copy_" if device.type == "cuda" else "host copy_ (no CUDA)"
    return [
        PathResult("host->gpu", total, h2d_s, raw_h2d_s, method),
        PathResult("gpu->host", total, d2h_s, raw_d2h_s, method),
    ]


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@dataclass
class SingleStream:
    """dd's single-stream figures on the NVMe directory: a reference beside the ceiling, not the ceiling."""

    nbytes: int
    read_s: float
    write_s: float
    method: str

    def as_dict(self) -> dict[str, object]:
        """JSON-ready figures."""
        return {**asdict(self), "read_gbps": self.nbytes / self.read_s / 1e9, "write_gbps": self.nbytes / self.write_s / 1e9}


def bench_nvme(store: TierStore, num_transfers: int, transfer_nbytes: int, repeats: int,
               ceiling_ios: int = 8) -> list[PathResult]:
    """NVMe->host and host->NVMe through the store, and the raw ceiling (``ceiling_ios`` IOs in flight) on
    the same directory, in the store's IO mode, over the same number of bytes."""
    keys = _register_random(store, "bench.nvme", num_transfers, transfer_nbytes, TierName.NVME)
    read_s = _best_of(repeats, lambda: _time_fetch(store, keys, TierName.HOST))
    write_s = _best_of(repeats, lambda: _time_writeback(store, keys, TierName.HOST, TierName.NVME))
    for key in keys:
        store.unregister(key)
    directory = store.tiers[TierName.NVME].directory
    total = num_transfers * transfer_nbytes
    ceiling = measure_disk_ceiling(directory.path, ios_in_flight=ceiling_ios, total_nbytes=total,
                                   repeats=max(2, repeats), direct=directory.io_mode == "direct")
    # The ceiling's own pass size (whole blocks) may differ from the store's bytes: compare as rates.
    raw_read_s, raw_write_s = total / (ceiling.read_gbps * 1e9), total / (ceiling.write_gbps * 1e9)
    return [
        PathResult("nvme->host", total, read_s, raw_read_s, ceiling.describe()),
        PathResult("host->nvme", total, write_s, raw_write_s, ceiling.describe()),
    ]


def bench_single_stream(store: TierStore, num_transfers: int, transfer_nbytes: int, repeats: int) -> SingleStream:
    """dd, one stream, on the NVMe directory in the store's IO mode: the figure earlier tables used as the
    ceiling, kept for comparison."""
    directory = store.tiers[TierName.NVME].directory
    direct = directory.io_mode == "direct"
    write_s, read_s, method = _dd_ceiling(directory.path, num_transfers, transfer_nbytes, direct, repeats)
    return SingleStream(num_transfers * transfer_nbytes, read_s, write_s, method + ", 1 stream")


def _dd_ceiling(directory: Path, count: int, block_nbytes: int, direct: bool, repeats: int) -> tuple[float, float, str]:
    """Sequential write then read of count x block_nbytes with dd (the OS's own path) in directory.

    dd opens its output by name, following links, so the file lives in a private 0700 subdirectory created
    for it (a fresh random name): no link planted in ``directory`` is ever opened."""
    dd = shutil.which("dd")
    if dd is None:
        raise RuntimeError("dd is not on PATH; the raw disk ceiling needs it")
    private = tempfile.TemporaryDirectory(prefix=".tierstore-bench-", dir=directory)
    target = Path(private.name) / "bench.dd.raw"
    flag_w = ["oflag=direct"] if direct else []
    flag_r = ["iflag=direct"] if direct else []
    bs = f"bs={block_nbytes}"

    def write() -> float:
        start = time.perf_counter()
        subprocess.run([dd, "if=/dev/zero", f"of={target}", bs, f"count={count}", "conv=notrunc", *flag_w], check=True, capture_output=True)
        return time.perf_counter() - start

    def read() -> float:
        start = time.perf_counter()
        subprocess.run([dd, f"if={target}", "of=/dev/null", bs, f"count={count}", *flag_r], check=True, capture_output=True)
        return time.perf_counter() - start

    try:
        write_s = _best_of(repeats, write)
        read_s = _best_of(repeats, read)
    finally:
        private.cleanup()
    return write_s, read_s, "dd " + ("O_DIRECT" if direct else "buffered")


def run_store_bench(nvme_dir: str | None, total_nbytes: int, transfer_nbytes: int, repeats: int = 3,
                    io_threads: int = 4, device: str | None = None, *, ceiling_ios: int = 8,
                    single_stream: list[SingleStream] | None = None) -> list[PathResult]:
    """Measure every path; returns one PathResult per path (NVMe paths only when nvme_dir is given).
    ``ceiling_ios``: IOs in flight in the disk's raw ceiling. ``single_stream``: a list that receives dd's
    single-stream figures when the NVMe paths are measured."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    num_transfers = max(1, total_nbytes // transfer_nbytes)
    host_nbytes = num_transfers * (transfer_nbytes + 4096) + (1 << 20)
    tmp = None
    if nvme_dir == "tmp":
        tmp = tempfile.TemporaryDirectory(prefix="tierstore-bench-")
        nvme_dir = tmp.name
    config = StoreConfig(device=device, host_budget_nbytes=host_nbytes, nvme_path=nvme_dir,
                         nvme_budget_nbytes=num_transfers * (transfer_nbytes + 8192) + (1 << 20), io_threads=io_threads,
                         io_block_nbytes=min(transfer_nbytes, 64 << 20) // 4096 * 4096 or 4096)
    results: list[PathResult] = []
    try:
        with TierStore(config) as store:
            results += bench_pcie(store, num_transfers, transfer_nbytes, repeats)
            if nvme_dir is not None:
                results += bench_nvme(store, num_transfers, transfer_nbytes, repeats, ceiling_ios)
                if single_stream is not None:
                    single_stream.append(bench_single_stream(store, num_transfers, transfer_nbytes, repeats))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return results


def format_store_table(results: list[PathResult], device_name: str, single_stream: SingleStream | None = None) -> str:
    """A fixed-width table of store vs raw bandwidth and their ratio; dd's single stream below it, labelled
    as such and left out of the ratios."""
    lines = [f"store bandwidth on {device_name}", f"{'path':<12}{'MiB':>8}{'store GB/s':>12}{'raw GB/s':>10}{'store/raw':>11}  raw ceiling"]
    for r in results:
        lines.append(f"{r.path:<12}{r.nbytes / 2**20:>8.0f}{r.store_gbps:>12.2f}{r.raw_gbps:>10.2f}{r.ratio:>11.2f}  {r.raw_method}")
    if single_stream is not None:
        figures = single_stream.as_dict()
        lines.append(f"single stream ({single_stream.method}; not the ceiling): read {figures['read_gbps']:.2f} GB/s, "
                     f"write {figures['write_gbps']:.2f} GB/s")
    return "\n".join(lines)
