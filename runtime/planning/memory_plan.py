"""The memory plan: bytes per tier per kind of state, computed before anything is allocated.

``make_plan`` turns block sizes and a config into exact byte counts (the same alignment the store uses), so
the host arena can be sized to the byte and a plan that cannot fit is refused with the numbers and a
suggested change before a single page is pinned. ``check_fits`` is that refusal: the config's budgets against
the plan, and the plan against the RAM this process may use (``runtime.planning.hostmem``: cgroup limits; swap files
on tmpfs count as RAM), the disk and the GPU budget. ``offload()`` and ``tierstore plan`` both reach it
through ``runtime.planning.placement.plan_blocks``.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from runtime.config.loader import TierstoreConfig
from runtime.config.units import approx_size
from runtime.planning.buffers import (
    DEVICE_MOMENT_PIECE_NUMEL,
    FETCH_PIECE_NUMEL,
    MOMENT_SCRATCH_ITEMSIZE,
    PIECE_NUMEL,
    STAGING_SLOTS,
    allocator_limit_nbytes,
)
from runtime.planning.hostmem import HostMemory, host_memory, ram_backed
from tierstore import align_up, swap_tmp_root

log = logging.getLogger(__name__)

IO_ALIGNMENT = 4096
HEADER_NBYTES = 4096
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
MOMENT_KINDS = ("exp_avg", "exp_avg_sq")
# Streamed blocks' master + moments on the device at once outside the activations' memory: the one being
# updated, the next, one being written back. Blocks further ahead (optimizer.gpu_stream_ahead) only use
# memory the backward freed and within the GPU budget the plan leaves free, so they add nothing to it.
STREAMED_IN_FLIGHT = 3
STAGING_BLOCKS = 5  # NVMe-resident states staged in host memory at once: worker look-ahead + write-backs in flight
PRE_COMMIT_BUFFERS = "pre-commit update buffers"  # the plan row of runtime.update.speculation's second state buffers
UNBOUNDED = 1 << 62  # the GPU budget on the CPU when none is set


class PlanError(ValueError):
    """The plan does not fit this machine; the message has the numbers and what to change."""


# A weight source (MemoryPlan.weight_source, the profile's config) as a person reads it: the plan's header and the
# profile report say the same.
WEIGHT_SOURCE_TEXT = {"master": "the fp32 master", "weights": "a compute-dtype copy in pinned memory", "resident": "resident"}


@dataclass
class MemoryPlan:
    """Bytes of every kind of state on every tier, and the totals each tier must provide."""

    num_params: int
    homes: dict[str, str]  # kind -> tier name
    weight_source: str  # master | weights | resident
    rows: list[tuple[str, str, int]] = field(default_factory=list)  # (kind, tier, nbytes)
    notes: tuple[str, ...] = ()  # lines printed under the header: what `auto` placement chose and why
    # The compute device's type ("cuda", "cpu"), recorded by ``check_fits``: on a CPU the "gpu" tier is the CPU's
    # memory outside the host arena, and the table calls it what it is (issue 41: no "gpu" rows on a CPU run).
    device_type: str = "cuda"

    @property
    def pre_commit_buffers(self) -> bool:
        """True when the plan holds second state buffers, so updates that wait for the commit may run early."""
        return any(kind == PRE_COMMIT_BUFFERS for kind, _, _ in self.rows)

    def tier_nbytes(self, tier: str) -> int:
        """Total bytes planned on one tier."""
        return sum(n for _, t, n in self.rows if t == tier)

    @property
    def host_nbytes(self) -> int:
        """The pinned arena size."""
        return self.tier_nbytes("host")

    @property
    def nvme_nbytes(self) -> int:
        """Disk bytes under the NVMe path."""
        return self.tier_nbytes("nvme")

    @property
    def gpu_nbytes(self) -> int:
        """GPU bytes of weights and gradients (activations come on top)."""
        return self.tier_nbytes("gpu")

    def tier_name(self, tier: str) -> str:
        """A tier as the table names it: the "gpu" tier is "device" where the device is the CPU."""
        return "device" if tier == "gpu" and self.device_type != "cuda" else tier

    def table(self) -> str:
        """A table for a person: one row per kind and tier, then totals."""
        source = WEIGHT_SOURCE_TEXT.get(self.weight_source, self.weight_source)
        width = max([32, *(len(kind) + 2 for kind, _, _ in self.rows)])  # a long label never runs into its tier
        cpu = [CPU_DEVICE_NOTE] if self.device_type != "cuda" else []
        lines = [f"memory plan: {self.num_params:,} parameters; weights fetched from {source}",
                 *(f"  {note}" for note in [*cpu, *self.notes]), f"  {'state':<{width}}{'tier':<6}{'bytes':>14}"]
        for kind, tier, nbytes in self.rows:
            lines.append(f"  {_device_text(kind, self.device_type):<{width}}{self.tier_name(tier):<6}{approx_size(nbytes):>14}")
        for tier in ("gpu", "host", "nvme"):
            lines.append(f"  {'total':<{width}}{self.tier_name(tier):<6}{approx_size(self.tier_nbytes(tier)):>14}")
        return "\n".join(lines)


# The plan's line on a CPU: what its "device" rows are.
CPU_DEVICE_NOTE = ("the device is the CPU (no CUDA): 'device' rows are its memory outside the host arena "
                   "(tiers.gpu.budget bounds them)")


def _device_text(kind: str, device_type: str) -> str:
    """A row's label with "GPU" said as "device" where the device is the CPU."""
    return kind if device_type == "cuda" else kind.replace("GPU", "device")


def make_plan(block_numels: list[int], homes: dict[str, str], weight_source: str, compute_itemsize: int,
              prefetch_depth: int, accumulation_steps: int, gpu_updated_numels: list[int] | None = None,
              spilled: int = 0, streamed: int = 0, spares: bool = False, host_sums: bool = False,
              grad_itemsize: int = 4, moment_dtype: str = "fp32", moment_nbytes: list[int] | None = None,
              gpu_moment_nbytes: list[int] | None = None) -> MemoryPlan:
    """Exact bytes per tier for blocks of the given sizes and the resolved placement ``homes``
    (kind -> 'host' | 'nvme' | 'gpu' for master, exp_avg, exp_avg_sq, weights). ``gpu_updated_numels``:
    blocks whose optimizer state and weights live on the GPU (optimizer.gpu_update_fraction). ``spilled``:
    the last that many of ``block_numels`` keep their moments on NVMe although ``homes`` says host
    (``placement.moments: auto`` when host memory cannot hold them all; see ``spill_moments``). ``streamed``:
    the first that many of ``block_numels`` are updated on the GPU over state streamed from host
    (``optimizer.gpu_stream_fraction``): no host gradient, a few blocks of device state in flight. ``spares``:
    the CPU-updated blocks whose state lives in host memory get second buffers for their master and moments,
    so their updates run before the step commits (see [Note: speculative updates] in runtime.update.speculation).
    ``host_sums``: the micro-batches' gradients of the host-updated blocks are summed in their host gradient
    buffers (``optimizer.accumulate_on: host``; see [Note: host gradient sums] in runtime.engine.host_sums).
    ``grad_itemsize``: bytes an element of those host gradient buffers (``optimizer.host_grad_dtype``).
    ``moment_dtype``: how the host-updated blocks' moments are stored (``optimizer.moment_dtype``), with
    ``moment_nbytes`` the bytes of one moment of each of ``block_numels`` in it (``runtime.update.moments.moment_nbytes``;
    None: fp32's 4 a value), ``gpu_moment_nbytes`` the same of each of ``gpu_updated_numels``."""
    gpu_updated_numels = gpu_updated_numels or []
    moments = _MomentSizes(moment_dtype, moment_nbytes or [4 * n for n in block_numels])
    gpu_moments = gpu_moment_nbytes or [4 * n for n in gpu_updated_numels]
    plan_homes = dict(homes)
    if spilled and homes["exp_avg"] == "host":
        plan_homes["exp_avg"] = plan_homes["exp_avg_sq"] = "host+nvme"
    plan = MemoryPlan(num_params=sum(block_numels) + sum(gpu_updated_numels), homes=plan_homes, weight_source=weight_source)
    largest = max(block_numels + gpu_updated_numels, default=0)
    if gpu_updated_numels:
        n = sum(gpu_updated_numels)
        plan.rows.append(("device-updated master + moments", "gpu", 4 * n + 2 * sum(gpu_moments)))
        plan.rows.append(("device-updated weights", "gpu", n * compute_itemsize))
    on_disk = set(spill_order(block_numels, streamed)[:spilled])
    plan.rows.extend(_state_rows(block_numels, homes, on_disk, spilled, largest, moments))
    grad_name = "fp32" if grad_itemsize == 4 else "compute dtype"
    plan.rows.append((f"gradients ({grad_name}, offloaded)", "host",
                      sum(_host_nbytes(n, grad_itemsize) for n in block_numels[streamed:])))
    if spares and all(homes[kind] == "host" for kind in STATE_KINDS):
        plan.rows.append((PRE_COMMIT_BUFFERS, "host", sum(
            _host_nbytes(n, 4) + len(MOMENT_KINDS) * _host_nbytes(moments.nbytes[p], 1)
            for p, n in enumerate(block_numels) if p >= streamed and p not in on_disk)))
    if streamed:
        in_flight = min(streamed, STREAMED_IN_FLIGHT)
        plan.rows.append((f"streamed update state ({in_flight} blocks)", "gpu",
                          in_flight * max(4 * n + 2 * moments.nbytes[p] for p, n in enumerate(block_numels[:streamed]))))
    if moment_dtype != "fp32" and (gpu_updated_numels or streamed):
        # runtime.update.device_updates' scratch: a piece, at most a block's values (int8: padded to whole blocks of
        # codes, so no more than its stored bytes; bf16: half of them).
        largest = max(gpu_moments + moments.nbytes[:streamed])
        plan.rows.append(("compact moment scratch (fp32)", "gpu",
                          MOMENT_SCRATCH_ITEMSIZE * min(DEVICE_MOMENT_PIECE_NUMEL, largest)))
    plan.rows.extend(_weight_rows(block_numels, weight_source, compute_itemsize, prefetch_depth, largest))
    plan.rows.append(("gradient assembly (fp32)", "gpu", largest * 4))
    if accumulation_steps > 1 and host_sums:
        plan.rows.extend(_host_sum_rows(block_numels, gpu_updated_numels, streamed, compute_itemsize, grad_itemsize))
    elif accumulation_steps > 1:
        plan.rows.append(("accumulated gradients", "gpu", plan.num_params * compute_itemsize))
    return plan


Row = tuple[str, str, int]  # (kind, tier, nbytes): one line of the plan


def _host_nbytes(numel: int, itemsize: int) -> int:
    """Bytes one host buffer of ``numel`` elements takes: aligned as the store aligns it (one byte at least)."""
    return align_up(max(numel * itemsize, 1), IO_ALIGNMENT)


@dataclass(frozen=True)
class _MomentSizes:
    """How the host-updated blocks' moments are stored: the format's name and one moment's bytes per block."""

    dtype: str  # optimizer.moment_dtype
    nbytes: list[int]  # parallel to the plan's block_numels


def _state_rows(block_numels: list[int], homes: dict[str, str], on_disk: set[int], spilled: int, largest: int,
                moments: _MomentSizes) -> list[Row]:
    """The host-updated blocks' fp32 master and moments (stored as ``moments`` says) at their homes: host, NVMe with
    its staging room, or (the moments of the ``spilled`` blocks at the positions ``on_disk``) spilled to NVMe from a
    host home."""
    rows: list[Row] = []
    for kind in STATE_KINDS:
        tier = homes[kind]
        # Bytes of this kind per block: the master 4 a value, a moment as its format stores it.
        sizes = [4 * n for n in block_numels] if kind == "master" else moments.nbytes
        name = "fp32" if kind == "master" else moments.dtype
        kept = [nbytes for p, nbytes in enumerate(sizes) if p not in on_disk]
        gone = [nbytes for p, nbytes in enumerate(sizes) if p in on_disk]
        if tier == "host" and kind != "master" and spilled:
            rows.append((f"{kind} ({name}, {len(kept)} blocks)", "host", sum(_host_nbytes(b, 1) for b in kept)))
            rows.append((f"{kind} ({name}, {spilled} spilled blocks)", "nvme",
                         sum(HEADER_NBYTES + _host_nbytes(b, 1) for b in gone)))
            rows.append((f"{kind} staging", "host", min(STAGING_BLOCKS, spilled) * _host_nbytes(max(gone), 1)))
        elif tier == "host":
            rows.append((f"{kind} ({name})", "host", sum(_host_nbytes(b, 1) for b in sizes)))
        elif tier == "nvme":
            rows.append((f"{kind} ({name})", "nvme", sum(HEADER_NBYTES + _host_nbytes(b, 1) for b in sizes)))
            # fp32 state stages in rooms as large as the largest block's (a device-updated one's included, as before)
            stage = 4 * largest if kind == "master" or moments.dtype == "fp32" else max(sizes, default=0)
            rows.append((f"{kind} staging", "host", min(STAGING_BLOCKS, len(sizes)) * _host_nbytes(stage, 1)))
    return rows


def _weight_rows(block_numels: list[int], weight_source: str, compute_itemsize: int, prefetch_depth: int,
                 largest: int) -> list[Row]:
    """The compute weights: a host copy in the compute dtype, resident on the GPU with their refresh staging, or the
    prefetch window on the GPU with the staging of fetches from the fp32 master."""
    rows: list[Row] = []
    if weight_source == "weights":
        rows.append(("weights (compute dtype)", "host", sum(_host_nbytes(n, compute_itemsize) for n in block_numels)))
    if weight_source == "resident":
        rows.append(("weights (resident)", "gpu", sum(block_numels) * compute_itemsize))
        rows.append(("refresh staging (fp32)", "gpu", largest * 4))
        return rows
    in_flight = min(len(block_numels), prefetch_depth + 2) if block_numels else 0
    window = window_bound(block_numels, in_flight)
    rows.append((f"weights ({in_flight} blocks in flight)", "gpu", window * compute_itemsize))
    if weight_source == "master" and compute_itemsize != 4:
        # The fetches stage one piece at a time ([Note: fetch staging]): the window's fp32 is not held at once.
        rows.append(("fetch staging (fp32)", "gpu", min(largest, FETCH_PIECE_NUMEL) * 4))
    return rows


def _host_sum_rows(block_numels: list[int], gpu_updated_numels: list[int], streamed: int, compute_itemsize: int,
                   grad_itemsize: int) -> list[Row]:
    """Micro-batch gradients summed in host memory (``optimizer.accumulate_on: host``): the device-updated and
    streamed blocks' sums on the GPU, the host-updated blocks' sum buffers and the pieces in flight to them."""
    rows: list[Row] = []
    grad_name = "fp32" if grad_itemsize == 4 else "compute dtype"
    on_device = sum(gpu_updated_numels) + sum(block_numels[:streamed])
    if on_device:
        rows.append(("accumulated gradients (GPU-updated)", "gpu", on_device * compute_itemsize))
    if block_numels[streamed:]:
        piece = min(PIECE_NUMEL, max(block_numels[streamed:]))
        rows.append((f"gradient sum buffers ({STAGING_SLOTS})", "host", STAGING_SLOTS * _host_nbytes(piece, grad_itemsize)))
        # The other micro-batches send their gradients out a piece at a time, up to one piece a staging buffer
        # in flight (each kept until its copy runs); the last brings the host sum in a piece at a time.
        rows.append((f"gradient assembly: host sum ({grad_name})", "gpu", STAGING_SLOTS * piece * grad_itemsize))
    return rows


def spill_order(block_numels: Sequence[int], streamed: int = 0) -> list[int]:
    """Positions of the host-updated blocks (``block_numels``, forward order; the first ``streamed`` never spill) in
    the order their moments go to NVMe. The last blocks first: their gradients arrive first in backward, so their
    updates have the most time to hide the disk, and the next forward needs them last. But blocks more than twice
    the median size (a large vocabulary's embedding and head) go after all the others: every staging room for
    spilled moments is as large as the largest spilled block, so one such block spilled would multiply them."""
    candidates = list(range(len(block_numels) - 1, streamed - 1, -1))
    if not candidates:
        return []
    sizes = sorted(block_numels[p] for p in candidates)
    oversized = 2 * sizes[len(sizes) // 2]
    return [p for p in candidates if block_numels[p] <= oversized] + [p for p in candidates if block_numels[p] > oversized]


def spill_moments(make: Callable[[int], MemoryPlan], num_blocks: int, host_limit_nbytes: int) -> int:
    """How many blocks must keep their moments on NVMe for the plan's pinned memory to fit ``host_limit_nbytes``,
    taken in ``spill_order``: the fewest that fit, or ``num_blocks`` (all that may spill) when even that does not.
    ``make(spilled)`` builds the plan for a count."""
    for spilled in range(num_blocks + 1):
        if make(spilled).host_nbytes <= host_limit_nbytes:
            return spilled
    return num_blocks


@dataclass(frozen=True)
class Budgets:
    """The byte budgets a store is built with, as ``check_fits`` checked them."""

    gpu_nbytes: int  # the GPU tier's budget (on the CPU: the explicit one, else unbounded)
    host_nbytes: int  # the pinned arena's size: the explicit budget, or exactly the plan's host bytes
    nvme_nbytes: int = 0  # the swap files' budget (tiers.nvme.budget: a rank's share of the node's, where several run)


def gpu_budget_nbytes(cfg: TierstoreConfig, device: torch.device) -> int:
    """``tiers.gpu.budget``; ``auto``: 90% of the device memory free now, and of what the process may still
    allocate under a ``torch.cuda.set_per_process_memory_fraction`` cap (unbounded on the CPU, where host memory
    is planned separately). The store enforces it on the CPU too, so an explicit budget is checked there."""
    if cfg.tiers.gpu.budget != "auto":
        return int(cfg.tiers.gpu.budget)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        limit = allocator_limit_nbytes(device)
        if limit is not None:  # under set_per_process_memory_fraction the cap, not the card, is what is left
            free = min(free, max(0, limit - torch.cuda.memory_reserved(device)))
        return int(free * 0.9)
    return UNBOUNDED


def check_fits(plan: MemoryPlan, cfg: TierstoreConfig, device: torch.device, *, memory: HostMemory | None = None) -> Budgets:
    """The checks ``tierstore plan`` and ``offload()`` both run before anything is allocated: the config's
    budgets against the plan, and the plan against this machine. Returns the budgets the store must use;
    raises PlanError naming every problem with its numbers. ``memory``: the host RAM to plan against
    (default: this process's now, cgroup limits included)."""
    plan.device_type = device.type  # the table names the "gpu" tier as what the device is
    budget = cfg.tiers.host.budget
    budgets = Budgets(gpu_nbytes=gpu_budget_nbytes(cfg, device),
                      host_nbytes=plan.host_nbytes if budget == "auto" else int(budget),
                      nvme_nbytes=cfg.tiers.nvme.budget)
    check_plan(plan, host_budget_nbytes=None if budget == "auto" else budgets.host_nbytes,
               gpu_budget_nbytes=budgets.gpu_nbytes, nvme_path=cfg.tiers.nvme.path,
               nvme_budget_nbytes=cfg.tiers.nvme.budget, memory=memory)
    return budgets


def check_plan(plan: MemoryPlan, *, host_budget_nbytes: int | None, gpu_budget_nbytes: int, nvme_path: str | None,
               nvme_budget_nbytes: int, memory: HostMemory | None = None) -> None:
    """Refuse a plan that does not fit its budgets, the RAM this process may use (``memory``; default: now),
    the disk under the NVMe path, or the GPU budget. ``host_budget_nbytes``: an explicit ``tiers.host.budget``
    (the arena's size), None for auto (the arena is the plan's host bytes)."""
    memory = host_memory() if memory is None else memory
    problems = []
    arena = plan.host_nbytes if host_budget_nbytes is None else host_budget_nbytes
    if host_budget_nbytes is not None and host_budget_nbytes < plan.host_nbytes:
        problems.append(f"host: tiers.host.budget is {approx_size(host_budget_nbytes)} ({host_budget_nbytes:,} bytes) but "
                        f"the plan pins {approx_size(plan.host_nbytes)} ({plan.host_nbytes:,} bytes); raise it or write auto")
    swap = _swap_directory(nvme_path)
    in_ram = ram_backed(swap) if swap is not None and plan.nvme_nbytes else None
    ram_nbytes = arena + (plan.nvme_nbytes if in_ram else 0)
    if ram_nbytes > memory.usable_nbytes:
        on_swap = f" plus the swap files on {swap} ({in_ram}: RAM) {approx_size(plan.nvme_nbytes)}" if in_ram else ""
        if host_budget_nbytes is not None and host_budget_nbytes > memory.usable_nbytes:
            problems.append(f"host: tiers.host.budget {approx_size(arena)}{on_swap} is more RAM than this process may use "
                            f"({memory.describe()}); lower it or write auto")
        else:
            problems.append(f"host: the plan pins {approx_size(arena)} ({arena:,} bytes){on_swap} but this process has "
                            f"{memory.describe()}; {_host_hint(plan, in_ram)}")
    if plan.gpu_nbytes > gpu_budget_nbytes:
        problems.append(f"{plan.tier_name('gpu')}: weights and gradients need {approx_size(plan.gpu_nbytes)} but tiers.gpu.budget is "
                        f"{approx_size(gpu_budget_nbytes)}; raise it, lower prefetch.depth or keep weights on host "
                        "(placement.weights: host)")
    if plan.nvme_nbytes:
        if nvme_path is None or swap is None:
            problems.append("nvme: the placement puts state on nvme but tiers.nvme.path is null; set it")
        else:
            if plan.nvme_nbytes > nvme_budget_nbytes:
                problems.append(f"nvme: the plan needs {approx_size(plan.nvme_nbytes)} but tiers.nvme.budget is "
                                f"{approx_size(nvme_budget_nbytes)}; raise it")
            free = shutil.disk_usage(swap).free if os.path.isdir(swap) else 0
            if plan.nvme_nbytes > free:
                problems.append(f"nvme: the plan needs {approx_size(plan.nvme_nbytes)} on {swap} but only "
                                f"{approx_size(free)} is free; free space or pick another path (tiers.nvme.path)")
    if problems:
        raise PlanError("the memory plan does not fit:\n  " + "\n  ".join(problems) + "\n" + plan.table())


def planned_ram_nbytes(plan: MemoryPlan, nvme_path: str | None) -> int:
    """RAM the plan takes: its pinned bytes, plus its swap files when they live on tmpfs."""
    swap = _swap_directory(nvme_path)
    return plan.host_nbytes + (plan.nvme_nbytes if swap is not None and plan.nvme_nbytes and ram_backed(swap) else 0)


def _swap_directory(nvme_path: str | None) -> str | None:
    """The directory swap files go to (``tmp``: where the store makes its temporary one)."""
    return swap_tmp_root() if nvme_path == "tmp" else nvme_path


def _host_hint(plan: MemoryPlan, swap_in_ram: str | None) -> str:
    if swap_in_ram:
        return "put tiers.nvme.path on a disk (the tmp path is RAM) or use a machine with more RAM"
    # The config's keys: master, and both moments under one (the plan's state kinds are exp_avg / exp_avg_sq).
    keys = list(dict.fromkeys("master" if k == "master" else "moments"
                              for k in STATE_KINDS if plan.homes[k].startswith("host")))
    if not keys:
        return "use a machine with more RAM"
    return (f"move the optimizer state to nvme ({', '.join(f'placement.{k}: nvme' for k in keys)}, with tiers.nvme.path set), or "
            "let the moments that do not fit spill there (placement.moments: auto with tiers.nvme.path)")


def window_bound(sizes: list[int], count: int) -> int:
    """The most that ``count`` distinct blocks of these sizes can hold together: the sum of the ``count`` largest.
    The weights on the GPU are the block in use, those fetched ahead and the one being released; in the
    usual schedule neighbours, but a tied head held through the backward, a checkpoint segment of several
    blocks or a fetch raced by an update make other sets, so the plan and the controller count the largest
    ones (for Llama-3-8B with its embedding updated on the GPU: the head and three layers, not four times the
    head)."""
    return sum(sorted(sizes, reverse=True)[: max(0, count)])


class WeightSource(StrEnum):
    """Where a block's compute weights are fetched from."""

    MASTER = "master"  # the fp32 master on host: H2D fp32, cast on the GPU (no extra pass over host memory)
    WEIGHTS = "weights"  # a host copy in the compute dtype, written by the optimizer worker
    RESIDENT = "resident"  # kept on the GPU; refreshed from the master after each update
