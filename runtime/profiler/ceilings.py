"""Bandwidth ceilings for the profiler: what each path can reach on this machine, in GB/s (1e9 bytes).

Either measured quickly at start (:func:`measure_ceilings`: one pinned copy each way, one file written and read
in the NVMe directory, best of a few) or taken from a ``tierstore bench store --json`` result
(:func:`ceilings_from_store_bench`, the raw ceilings of that bench).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from tierstore import TierName, TierStore

log = logging.getLogger(__name__)

STORE_BENCH_PATHS = {"host->gpu": "h2d", "gpu->host": "d2h", "nvme->host": "read", "host->nvme": "write"}
IO_CHUNK = 8 << 20


def ceilings_from_store_bench(results: str | os.PathLike[str] | Mapping[str, Any] | Iterable[Any]) -> dict[str, float]:
    """Raw ceilings (GB/s) from ``tierstore bench store`` results: a JSON file's path, its parsed content,
    or a list of ``PathResult``."""
    if isinstance(results, (str, os.PathLike)):
        results = json.loads(Path(results).read_text())
    rows = results.get("results", []) if isinstance(results, Mapping) else list(results)
    out: dict[str, float] = {}
    for row in rows:
        row = row if isinstance(row, Mapping) else row.as_dict()
        kind = STORE_BENCH_PATHS.get(str(row.get("path")))
        if kind is not None:
            out[kind] = float(row["raw_gbps"])
    return out


def _best_s(repeats: int, run: Any) -> float:
    run()  # warm-up: first touch of the pages, CUDA context, file allocation
    return min(run() for _ in range(repeats))


def measure_ceilings(store: TierStore, nbytes: int = 32 << 20, repeats: int = 3) -> dict[str, float]:
    """Measure h2d / d2h (a plain copy between a pinned buffer and the device; host memcpy without CUDA) and,
    when the store has an NVMe tier, read / write of one file in its directory with the same IO mode
    (O_DIRECT or buffered). Takes well under a second for the default size; moves nothing through the store."""
    out: dict[str, float] = {}
    device = store.device
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(to_device: bool) -> float:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        (target.copy_(host, non_blocking=True) if to_device else host.copy_(target, non_blocking=True))
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    out["h2d"] = nbytes / _best_s(repeats, lambda: copy(True)) / 1e9
    out["d2h"] = nbytes / _best_s(repeats, lambda: copy(False)) / 1e9
    del host, target
    nvme = store.tiers.get(TierName.NVME)
    if nvme is not None:
        directory = nvme.directory  # type: ignore[attr-defined]
        write_gbps, read_gbps = _file_ceilings(Path(directory.path), nbytes, directory.io_mode == "direct", repeats)
        out["write"], out["read"] = write_gbps, read_gbps
    log.info("bandwidth ceilings (GB/s): %s", ", ".join(f"{k} {v:.2f}" for k, v in out.items()))
    return out


def _file_ceilings(directory: Path, nbytes: int, direct: bool, repeats: int) -> tuple[float, float]:
    """Sequential write (with fsync) then read of one file, in IO_CHUNK pieces from a page-aligned buffer.

    The file lives in a private 0700 subdirectory created for it (mkdtemp: a fresh random name, never an
    existing one), so no link planted in ``directory`` is ever opened; the subdirectory goes afterwards."""
    nbytes = max(4096, nbytes // 4096 * 4096)
    chunk = min(IO_CHUNK, nbytes)
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
    buf.write(b"\x5a" * chunk)
    private = tempfile.TemporaryDirectory(prefix=".tierstore-ceiling-", dir=directory)
    path = Path(private.name) / "probe"
    flags = os.O_DIRECT if direct and hasattr(os, "O_DIRECT") else 0

    def write() -> float:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600)
        try:
            start = time.perf_counter()
            for offset in range(0, nbytes, chunk):
                os.pwrite(fd, buf, offset)
            os.fsync(fd)
            return time.perf_counter() - start
        finally:
            os.close(fd)

    def read() -> float:
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)  # a page-cache hit is not the disk
            start = time.perf_counter()
            for offset in range(0, nbytes, chunk):
                os.preadv(fd, [buf], offset)
            return time.perf_counter() - start
        finally:
            os.close(fd)

    try:
        write_s = _best_s(repeats, write)
        read_s = _best_s(repeats, read)
    finally:
        private.cleanup()
        buf.close()
    return nbytes / write_s / 1e9, nbytes / read_s / 1e9
