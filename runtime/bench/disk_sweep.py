"""``tierstore bench store --disk-sweep``: the disk's read and write bandwidth over a grid of IOs in flight and IO
sizes, to choose ``tiers.nvme.io_threads`` and ``tiers.nvme.block_size``.

The store reads and writes each swap file on one of ``io_threads`` threads, one ``block_size`` IO at a time,
so a point of the grid (``ios_in_flight`` threads, each with one aligned ``block_nbytes`` IO at a time, O_DIRECT
where the file system takes it: :func:`runtime.profiler.ceilings.measure_disk_ceiling`) is what those two
settings can get from the disk. Disks differ: on the lent H100 machine's virtio disk the 8B scenario read its
spilled moments at 1.0-1.1 GB/s with 8 threads of 64 MiB IOs, which the default ceiling (8 x 8 MiB) matched,
while a single-stream ``dd`` was reported at 1.6 GB/s there (issue 15): the sweep shows which shape of IO
this disk serves fastest. A cloud disk may also serve a short burst faster than its sustained rate (the 8B
step reads 22.7 GB), so a point's figure counts only where ``--total`` is large against such a burst. What it
leaves out: the store's own overheads (checksums, the header), which
``tierstore bench store`` measures beside its ceiling.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from runtime.config.units import format_size
from runtime.profiler.ceilings import measure_disk_ceiling

IOS_IN_FLIGHT = (1, 2, 4, 8, 16)
BLOCK_NBYTES = (8 << 20, 64 << 20)


@dataclass(frozen=True)
class SweepPoint:
    """One point of the grid: the store's ``io_threads`` and ``block_size`` and what the disk gave them."""

    ios_in_flight: int
    block_nbytes: int
    read_gbps: float
    write_gbps: float
    method: str  # O_DIRECT or buffered (with the page cache dropped before reads)


def disk_sweep(directory: str, *, ios_in_flight: Iterable[int] = IOS_IN_FLIGHT,
               block_nbytes: Iterable[int] = BLOCK_NBYTES, total_nbytes: int = 1 << 30,
               repeats: int = 2) -> list[SweepPoint]:
    """Every (IOs in flight, IO size) pair over one file in ``directory`` of ``total_nbytes``, or of two IOs per
    thread where that is more (so every point moves the IO size it names), best of ``repeats`` passes each."""
    points = []
    for block in block_nbytes:
        for ios in ios_in_flight:
            ceiling = measure_disk_ceiling(directory, ios_in_flight=ios, block_nbytes=block,
                                           total_nbytes=max(total_nbytes, 2 * ios * block), repeats=repeats)
            points.append(SweepPoint(ios, ceiling.block_nbytes, ceiling.read_gbps, ceiling.write_gbps,
                                     ceiling.io_mode_name))
    return points


def format_disk_sweep(points: list[SweepPoint], directory: str) -> str:
    """A grid of read / write GB/s, one row per IO size, one column per IOs in flight, and the settings of the
    fastest read (what an optimizer waiting on spilled moments needs most) and of the fastest write."""
    if not points:
        raise ValueError("no sweep points to format")
    ios = sorted({p.ios_in_flight for p in points})
    blocks = sorted({p.block_nbytes for p in points})
    by = {(p.ios_in_flight, p.block_nbytes): p for p in points}
    lines = [f"disk sweep in {directory} ({points[0].method}): read / write GB/s by IOs in flight "
             "(tiers.nvme.io_threads) and IO size (tiers.nvme.block_size)",
             f"{'block_size':<12}" + "".join(f"{n:>14}" for n in ios)]
    for block in blocks:
        cells = [f"{by[n, block].read_gbps:.2f} / {by[n, block].write_gbps:.2f}" if (n, block) in by else "-" for n in ios]
        lines.append(f"{format_size(block):<12}" + "".join(f"{cell:>14}" for cell in cells))
    best_read = max(points, key=lambda p: p.read_gbps)
    best_write = max(points, key=lambda p: p.write_gbps)
    lines.append(f"fastest read {best_read.read_gbps:.2f} GB/s at io_threads: {best_read.ios_in_flight}, block_size: "
                 f"{format_size(best_read.block_nbytes)}; fastest write {best_write.write_gbps:.2f} GB/s at io_threads: "
                 f"{best_write.ios_in_flight}, block_size: {format_size(best_write.block_nbytes)}")
    return "\n".join(lines)
