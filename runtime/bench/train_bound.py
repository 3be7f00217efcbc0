"""The per-row lower bound of ``tierstore bench train``: what each resource must at least do in one step.

A row's placement (:class:`RowPlacement`: which parameters keep their weights on the GPU, which are
updated by the CPU or the GPU, which state streams or lives on disk) fixes the work of one optimizer step
on each resource (:func:`row_traffic`, pure arithmetic in ``runtime.planning.predict``, which ``tierstore plan --model``'s
prediction shares):

- the GPU: ``T_gpu = T_compute + T_gpu_update``, ``T_compute = accumulation x (T_fwd + T_bwd)`` of the plain
  PyTorch row of the same shape, ``T_gpu_update`` a fused AdamW on the GPU over the device-updated parameters
  (resident and streamed state alike);
- the CPU: ``T_cpu_adam``, fused CPU AdamW over the CPU-updated parameters (``1 - f - s`` of them) at the
  row's thread count;
- PCIe, each direction on its own (a copy engine each way): ``T_h2d`` = weights fetched + streamed state in
  (12 bytes per parameter) + weights refreshed after a CPU update (weights resident on the GPU, master on
  host); ``T_d2h`` = gradients of the CPU-updated parameters + streamed state out (12 bytes per parameter).
  Weights not resident on the GPU are fetched for each micro-batch's forward and again for its backward,
  except those kept from forward to backward (``-keep``'s budget, and always the last block of the forward:
  backward starts with it) and, in the first micro-batch's forward, the streamed ones (their update on the
  GPU leaves them there). Bytes per fetched weight are the source's: the fp32 master (4) or a bf16 copy (2);
- the disk: ``T_nvme`` = the longer of state bytes read / read ceiling and written / write ceiling. Not their
  sum: a disk may serve both at once, and on the H100 box's virtio disk it did (the ``nvme`` row read 9.9 GiB
  and wrote 9.5 GiB in a 10.3 s step, where the probed ceilings give 10.7 s for the reads and 4.7 s for the
  writes, 2026-11-26), so the sum was no lower bound.

Each term is the row's bytes or parameters over a rate measured in the same call (:class:`Rates`), and

    bound = max(T_gpu, T_cpu_adam, T_h2d, T_d2h, T_nvme)

since every resource must at least do its own work and no resource can be faster than its raw ceiling.
It is a lower bound: overheads (launches, casts, host copies, waits between resources) only add. Where a
tierstore row moved fewer bytes on a path than this accounting (its schedule kept more blocks), the bound
uses the bytes moved, so that it stays a lower bound; the table prints both. The table's "of bound" is
bound / measured step, at most 1: the fraction of the achievable this row reaches. A term whose rate was
not measured (no plain row, no disk directory) is left out and named as missing.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from runtime.bench import synchronize
from runtime.engine.schedule import joins_window
from runtime.planning.predict import FP32, RowPlacement, Traffic, disk_state_nbytes, row_traffic
from runtime.planning.predict import STATE_NBYTES as STATE_NBYTES  # re-exported: the DeepSpeed rows count with it
from runtime.update.rates import cpu_adam_seconds, pinned_copy_gbps

log = logging.getLogger(__name__)

ADAM_MEASURE_CAP_NUMEL = 256 << 20  # AdamW is timed over at most this many parameters (4 GiB of fp32 state) and scaled


def tierstore_placement(*, block_numels: list[int], gpu_updated: Iterable[int], streamed: Iterable[int],
                        weight_source: str, homes: dict[str, str], spilled: Iterable[int], keep_nbytes: int,
                        compute_elem_nbytes: int, accumulation: int, cpu_threads: int, prefetch_depth: int = 0,
                        prefetch_budget_nbytes: int = 0, moment_nbytes: list[int] | None = None) -> RowPlacement:
    """The placement of a tierstore session, from what its controller resolved: block sizes in forward
    order, the device-updated and streamed block indices, the weight source (``master``: the fp32 master is
    fetched and cast on the GPU; ``weights``: a host copy in the compute dtype; ``resident``: on the GPU,
    refreshed from the master after each CPU update), each state kind's home tier, the blocks whose moments
    spilled to NVMe, ``prefetch.keep_for_backward``'s budget in bytes of compute weights, and the prefetch depth
    and byte budget (what a backward leaves for the next micro-batch's forward), and each block's bytes of one moment
    as ``optimizer.moment_dtype`` stores it (None: fp32)."""
    gpu_updated, streamed, spilled = set(gpu_updated), set(streamed), set(spilled)
    total = sum(block_numels)
    device = sum(block_numels[i] for i in gpu_updated)
    streamed_numel = sum(block_numels[i] for i in streamed)
    resident = weight_source == "resident"
    fetched = [i for i in range(len(block_numels)) if not resident and i not in gpu_updated]
    kept = _kept_numel([block_numels[i] for i in fetched], keep_nbytes, compute_elem_nbytes)
    carried = _carried_numel([block_numels[i] for i in fetched], prefetch_depth, prefetch_budget_nbytes, compute_elem_nbytes)
    disk = disk_state_nbytes(block_numels, gpu_updated, homes, spilled, moment_nbytes)
    moments = moment_nbytes or [FP32 * n for n in block_numels]
    state = STATE_NBYTES if not streamed_numel else (
        sum(FP32 * block_numels[i] + 2 * moments[i] for i in streamed) / streamed_numel)
    return RowPlacement(num_params=total, accumulation=accumulation, resident_numel=total if resident else device,
                        fetch_elem_nbytes={"master": FP32, "weights": compute_elem_nbytes, "resident": 0}[weight_source],
                        kept_numel=kept, carried_numel=carried, fresh_numel=0 if resident else streamed_numel,
                        cpu_update_numel=total - device - streamed_numel, gpu_update_numel=device + streamed_numel,
                        streamed_numel=streamed_numel, refresh_elem_nbytes=FP32 if resident else 0,
                        disk_state_nbytes=disk, cpu_threads=cpu_threads, state_elem_nbytes=state)


def _kept_numel(fetched_numels: list[int], keep_nbytes: int, elem_nbytes: int) -> int:
    """Weights (of the fetched blocks, in forward order) still on the GPU when backward reaches them: the
    last block (backward starts with it), and the newest blocks within the keep budget, as the controller
    keeps them (a block larger than the whole budget is never kept; keeping one past what is left would
    release every older kept block)."""
    if not fetched_numels:
        return 0
    kept, budget = fetched_numels[-1], keep_nbytes
    for position, numel in enumerate(reversed(fetched_numels)):
        nbytes = numel * elem_nbytes
        if nbytes > keep_nbytes:
            continue
        if nbytes > budget:
            break
        budget -= nbytes
        kept += numel if position else 0  # the last block is counted already
    return kept


def _carried_numel(fetched_numels: list[int], depth: int, budget_nbytes: int, elem_nbytes: int) -> int:
    """Weights (of the fetched blocks, in forward order) a backward leaves on the GPU for the next micro-batch's
    forward ([Note: prefetch across micro-batches] in runtime.engine.fetch): the first ``depth`` blocks, within the
    prefetch byte budget (the first block always). It assumes the usual hook order, each block's gradients done
    before the next block's backward begins; a block whose gradients finish only at the backward's end (a
    parameter without one in that micro-batch) is kept too, one block more than counted here."""
    carried = total = count = 0
    for numel in fetched_numels:  # the window the schedule picks (PrefetchSchedule._pick)
        if not joins_window(count, total, numel * elem_nbytes, depth, budget_nbytes):
            break
        carried, total, count = carried + numel, total + numel * elem_nbytes, count + 1
    return carried


def plain_placement(num_params: int, accumulation: int) -> RowPlacement:
    """The plain PyTorch row: everything on the GPU, the whole update there."""
    return RowPlacement(num_params=num_params, accumulation=accumulation, resident_numel=num_params,
                        gpu_update_numel=num_params)


@dataclass(frozen=True)
class Rates:
    """Rates measured in the call; None where not measured."""

    fwd_s: float | None = None  # one forward of the plain row
    bwd_s: float | None = None  # one backward of the plain row
    gpu_adam_s_per_param: float | None = None
    cpu_adam_s_per_param: dict[int, float] = field(default_factory=dict)  # threads -> seconds per parameter
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    disk_read_gbps: float | None = None
    disk_write_gbps: float | None = None


@dataclass(frozen=True)
class Bound:
    """A row's bound: each resource's term (seconds; None where its rate was not measured), and their max."""

    terms: dict[str, float | None]
    traffic: Traffic  # the accounting
    nbytes: dict[str, int]  # the bytes each path's term uses: h2d, d2h, read, write
    gpu_parts: tuple[float, float] | None = None  # T_compute, T_gpu_update: T_gpu's two parts

    @property
    def seconds(self) -> float | None:
        """max over the terms measured; None when none was."""
        known = [t for t in self.terms.values() if t is not None]
        return max(known) if known else None

    @property
    def limit(self) -> str:
        """The name of the largest term."""
        known = {k: t for k, t in self.terms.items() if t is not None}
        return max(known, key=known.__getitem__) if known else "-"

    def describe(self) -> str:
        """'max(T_gpu 0.200 (T_compute 0.190 + T_gpu_update 0.010), T_cpu_adam 0.310, ...) = 0.310 s (T_cpu_adam)';
        a term not measured is named as such."""
        parts = [f"{k} {v:.3f}" if v is not None else f"{k} not measured" for k, v in self.terms.items()]
        if self.gpu_parts is not None:
            parts[0] += f" (T_compute {self.gpu_parts[0]:.3f} + T_gpu_update {self.gpu_parts[1]:.3f})"
        total = self.seconds
        return f"max({', '.join(parts)})" + (f" = {total:.3f} s ({self.limit})" if total is not None else "")


def row_bound(placement: RowPlacement, rates: Rates, default_threads: int,
              moved: dict[str, float] | None = None) -> Bound:
    """The bound of ``placement`` at ``rates`` (see the module docstring). ``moved``: the bytes a row moved per
    step on each path (``h2d``, ``d2h``, ``read``, ``write``), where it counted them; a path's term uses the
    smaller of that and the accounting."""
    t = row_traffic(placement)
    accounted = {"h2d": t.h2d_nbytes, "d2h": t.d2h_nbytes, "read": t.disk_read_nbytes, "write": t.disk_write_nbytes}
    used = {k: min(v, int(moved[k])) if moved and k in moved else v for k, v in accounted.items()}

    def over(nbytes: int, gbps: float | None) -> float | None:
        if not nbytes:
            return 0.0
        return None if gbps is None else nbytes / (gbps * 1e9)

    gpu = parts = None
    if rates.fwd_s is not None and rates.bwd_s is not None and rates.gpu_adam_s_per_param is not None:
        parts = (t.compute_passes * (rates.fwd_s + rates.bwd_s), t.gpu_update_numel * rates.gpu_adam_s_per_param)
        gpu = sum(parts)
    per_param = rates.cpu_adam_s_per_param.get(placement.cpu_threads or default_threads)
    cpu = 0.0 if not t.cpu_update_numel else (None if per_param is None else t.cpu_update_numel * per_param)
    read, write = over(used["read"], rates.disk_read_gbps), over(used["write"], rates.disk_write_gbps)
    nvme = None if read is None or write is None else max(read, write)  # both directions may overlap
    terms = {"T_gpu": gpu, "T_cpu_adam": cpu, "T_h2d": over(used["h2d"], rates.h2d_gbps),
             "T_d2h": over(used["d2h"], rates.d2h_gbps), "T_nvme": nvme}
    return Bound(terms, t, used, parts)


def measure_cpu_adam_s_per_param(num_params: int, threads: int) -> float:
    """Seconds per parameter of one CPU fused AdamW step (the runtime's own kernel) with ``threads``
    threads, over min(num_params, 256 Mi) fp32 parameters: far beyond any cache, so the rate is the memory
    bound one a whole model's step runs at; median of three after a warm-up."""
    numel = max(1, min(num_params, ADAM_MEASURE_CAP_NUMEL))
    return statistics.median(cpu_adam_seconds(numel, threads)) / numel


def measure_gpu_adam_s_per_param(num_params: int, device: torch.device) -> float:
    """Seconds per parameter of torch's fused AdamW on the compute device over min(num_params, 256 Mi) fp32
    parameters (on a GPU, the 28 bytes per parameter of an update at HBM speed, as the plain row and
    tierstore's device update run it)."""
    numel = max(1, min(num_params, ADAM_MEASURE_CAP_NUMEL))
    p = torch.nn.Parameter(torch.rand(numel, device=device))
    p.grad = torch.rand_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=True)
    opt.step()
    times = []
    for _ in range(3):
        synchronize()
        t0 = time.perf_counter()
        opt.step()
        synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / numel


def measure_pcie_gbps(nbytes: int = 1 << 30) -> tuple[float, float]:
    """Raw pinned copy bandwidth (H2D, D2H) in GB/s, best of three (``runtime.update.rates``, as the profiler's
    ceilings and auto placement measure it)."""
    return pinned_copy_gbps(torch.device("cuda"), nbytes, 3)


def measure_disk_gbps(directory: str, total_nbytes: int = 2 << 30) -> tuple[float, float]:
    """Raw (read, write) GB/s of the disk under ``directory``, several O_DIRECT IOs in flight as the store
    and DeepSpeed's aio keep them (``runtime.profiler.ceilings.disk_ceiling_gbps``); where that function is
    not available, single-stream ``dd``, which may read a lower ceiling and so overstate T_nvme."""
    try:
        from runtime.profiler.ceilings import disk_ceiling_gbps
    except ImportError:
        log.warning("runtime.profiler.ceilings.disk_ceiling_gbps is not available; measuring the disk with "
                    "single-stream dd instead: one IO in flight may read a lower ceiling than the disk's, which "
                    "overstates T_nvme (the bound may then exceed what the disk allows)")
    else:
        read, write = disk_ceiling_gbps(directory, ios_in_flight=8, block_nbytes=8 << 20, total_nbytes=total_nbytes)
        return float(read), float(write)
    from pathlib import Path

    from runtime.bench.store_bench import _dd_ceiling

    block = 64 << 20
    count = max(1, total_nbytes // block)
    write_s, read_s, _ = _dd_ceiling(Path(directory), count, block, direct=True, repeats=2)
    return count * block / read_s / 1e9, count * block / write_s / 1e9
