"""The memory plan: bytes per tier per kind of state, computed before anything is allocated.

``make_plan`` turns block sizes and a config into exact byte counts (the same alignment the store uses), so
the host arena can be sized to the byte and a plan that cannot fit is refused with the numbers and a
suggested change before a single page is pinned.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from runtime.units import format_size
from tierstore.allocator import align_up

log = logging.getLogger(__name__)

IO_ALIGNMENT = 4096
HEADER_NBYTES = 4096
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
# Streamed blocks' master + moments on the device at once outside the activations' memory: the one being
# updated, the next, one being written back. Blocks further ahead (optimizer.gpu_stream_ahead) only use
# memory the backward freed and within the GPU budget the plan leaves free, so they add nothing to it.
STREAMED_IN_FLIGHT = 3
STAGING_BLOCKS = 5  # NVMe-resident states staged in host memory at once: worker look-ahead + write-backs in flight


class PlanError(ValueError):
    """The plan does not fit this machine; the message has the numbers and what to change."""


@dataclass
class MemoryPlan:
    """Bytes of every kind of state on every tier, and the totals each tier must provide."""

    num_params: int
    homes: dict[str, str]  # kind -> tier name
    weight_source: str  # master | weights | resident
    rows: list[tuple[str, str, int]] = field(default_factory=list)  # (kind, tier, nbytes)

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

    def table(self) -> str:
        """A table for a person: one row per kind and tier, then totals."""
        lines = [f"memory plan: {self.num_params:,} parameters; weights fetched from {self.weight_source}",
                 f"  {'state':<32}{'tier':<6}{'bytes':>14}"]
        for kind, tier, nbytes in self.rows:
            lines.append(f"  {kind:<32}{tier:<6}{_human(nbytes):>14}")
        for tier in ("gpu", "host", "nvme"):
            lines.append(f"  {'total':<32}{tier:<6}{_human(self.tier_nbytes(tier)):>14}")
        return "\n".join(lines)


def _human(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def make_plan(block_numels: list[int], homes: dict[str, str], weight_source: str, compute_itemsize: int,
              prefetch_depth: int, accumulation_steps: int, gpu_updated_numels: list[int] | None = None,
              spilled: int = 0, streamed: int = 0) -> MemoryPlan:
    """Exact bytes per tier for blocks of the given sizes and the resolved placement ``homes``
    (kind -> 'host' | 'nvme' | 'gpu' for master, exp_avg, exp_avg_sq, weights). ``gpu_updated_numels``:
    blocks whose optimizer state and weights live on the GPU (optimizer.gpu_update_fraction). ``spilled``:
    the last that many of ``block_numels`` keep their moments on NVMe although ``homes`` says host
    (``placement.moments: auto`` when host memory cannot hold them all; see ``spill_moments``). ``streamed``:
    the first that many of ``block_numels`` are updated on the GPU over state streamed from host
    (``optimizer.gpu_stream_fraction``): no host gradient, a few blocks of device state in flight."""
    gpu_updated_numels = gpu_updated_numels or []
    plan_homes = dict(homes)
    if spilled and homes["exp_avg"] == "host":
        plan_homes["exp_avg"] = plan_homes["exp_avg_sq"] = "host+nvme"
    plan = MemoryPlan(num_params=sum(block_numels) + sum(gpu_updated_numels), homes=plan_homes, weight_source=weight_source)
    largest = max(block_numels + gpu_updated_numels, default=0)
    if gpu_updated_numels:
        n = sum(gpu_updated_numels)
        plan.rows.append(("device-updated master + moments", "gpu", 3 * 4 * n))
        plan.rows.append(("device-updated weights", "gpu", n * compute_itemsize))

    def host_bytes(numel: int, itemsize: int) -> int:
        return align_up(max(numel * itemsize, 1), IO_ALIGNMENT)

    kept = len(block_numels) - spilled
    for kind in STATE_KINDS:
        tier = homes[kind]
        if tier == "host" and kind != "master" and spilled:
            plan.rows.append((f"{kind} (fp32, first {kept} blocks)", "host", sum(host_bytes(n, 4) for n in block_numels[:kept])))
            plan.rows.append((f"{kind} (fp32, last {spilled} blocks)", "nvme",
                              sum(HEADER_NBYTES + host_bytes(n, 4) for n in block_numels[kept:])))
            plan.rows.append((f"{kind} staging", "host", min(STAGING_BLOCKS, spilled) * host_bytes(max(block_numels[kept:]), 4)))
        elif tier == "host":
            plan.rows.append((f"{kind} (fp32)", "host", sum(host_bytes(n, 4) for n in block_numels)))
        elif tier == "nvme":
            plan.rows.append((f"{kind} (fp32)", "nvme", sum(HEADER_NBYTES + host_bytes(n, 4) for n in block_numels)))
            plan.rows.append((f"{kind} staging", "host", min(STAGING_BLOCKS, len(block_numels)) * host_bytes(largest, 4)))
    plan.rows.append(("gradients (fp32, offloaded)", "host", sum(host_bytes(n, 4) for n in block_numels[streamed:])))
    if streamed:
        in_flight = min(streamed, STREAMED_IN_FLIGHT)
        plan.rows.append((f"streamed update state ({in_flight} blocks)", "gpu", in_flight * 3 * 4 * max(block_numels[:streamed])))
    if weight_source == "weights":
        plan.rows.append(("weights (compute dtype)", "host", sum(host_bytes(n, compute_itemsize) for n in block_numels)))
    if weight_source == "resident":
        plan.rows.append(("weights (resident)", "gpu", sum(block_numels) * compute_itemsize))
        plan.rows.append(("refresh staging (fp32)", "gpu", largest * 4))
    else:
        in_flight = min(len(block_numels), prefetch_depth + 2) if block_numels else 0
        plan.rows.append((f"weights ({in_flight} blocks in flight)", "gpu", in_flight * largest * compute_itemsize))
        if weight_source == "master" and compute_itemsize != 4:
            plan.rows.append(("fetch staging (fp32)", "gpu", in_flight * largest * 4))
    plan.rows.append(("gradient assembly (fp32)", "gpu", largest * 4))
    if accumulation_steps > 1:
        plan.rows.append(("accumulated gradients", "gpu", plan.num_params * compute_itemsize))
    return plan


def spill_moments(make: Callable[[int], MemoryPlan], num_blocks: int, host_limit_nbytes: int) -> int:
    """How many of the last blocks must keep their moments on NVMe for the plan's pinned memory to fit
    ``host_limit_nbytes``: the fewest that fit, or ``num_blocks`` (all that may spill) when even that does
    not. ``make(spilled)`` builds the plan for a count. The last blocks spill first: their gradients arrive first in backward, so their
    updates have the most time to hide the disk, and the next forward needs them last."""
    for spilled in range(num_blocks + 1):
        if make(spilled).host_nbytes <= host_limit_nbytes:
            return spilled
    return num_blocks


def available_host_nbytes() -> int:
    """Host memory this process may still use: psutil's available, capped by a cgroup v2/v1 limit."""
    available = psutil.virtual_memory().available
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit_text = Path(limit_path).read_text().strip()
            if limit_text != "max" and int(limit_text) < 1 << 60:
                available = min(available, int(limit_text) - int(Path(usage_path).read_text().strip()))
            break
        except (OSError, ValueError):
            continue
    return max(available, 0)


def host_headroom_nbytes(total: int) -> int:
    """Memory left to the rest of the process and the OS: 10% or 2 GiB, whichever is more."""
    return max(total // 10, 2 << 30)


def check_plan(plan: MemoryPlan, gpu_budget_nbytes: int, nvme_path: str | None, nvme_budget_nbytes: int,
               host_available_nbytes: int | None = None) -> None:
    """Refuse a plan that does not fit the host RAM, the disk under the NVMe path, or the GPU budget."""
    available = available_host_nbytes() if host_available_nbytes is None else host_available_nbytes
    usable = available - host_headroom_nbytes(psutil.virtual_memory().total)
    problems = []
    if plan.host_nbytes > usable:
        moveable = [k for k in STATE_KINDS if plan.homes[k].startswith("host")]
        hint = (f"move {' and '.join(moveable)} to nvme (placement.{moveable[-1]}: nvme), or let the moments that do "
                "not fit spill there (placement.moments: auto with tiers.nvme.path)") if moveable else "use a machine with more RAM"
        problems.append(f"host: the plan pins {format_size(plan.host_nbytes)} ({_human(plan.host_nbytes)}) but only "
                        f"{_human(max(usable, 0))} is available after headroom; {hint}")
    if plan.gpu_nbytes > gpu_budget_nbytes:
        problems.append(f"gpu: weights and gradients need {_human(plan.gpu_nbytes)} but tiers.gpu.budget is "
                        f"{_human(gpu_budget_nbytes)}; lower prefetch.depth or keep weights on host (placement.weights: host)")
    if plan.nvme_nbytes:
        if nvme_path is None:
            problems.append("nvme: the placement puts state on nvme but tiers.nvme.path is null; set it")
        else:
            if plan.nvme_nbytes > nvme_budget_nbytes:
                problems.append(f"nvme: the plan needs {_human(plan.nvme_nbytes)} but tiers.nvme.budget is {_human(nvme_budget_nbytes)}; raise it")
            probe = nvme_path if nvme_path != "tmp" else _tmp_root()
            free = shutil.disk_usage(probe).free if os.path.isdir(probe) else 0
            if plan.nvme_nbytes > free:
                problems.append(f"nvme: the plan needs {_human(plan.nvme_nbytes)} on {probe} but only {_human(free)} is free; free space or pick another path")
    if problems:
        raise PlanError("the memory plan does not fit:\n  " + "\n  ".join(problems) + "\n" + plan.table())


def _tmp_root() -> str:
    import tempfile

    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def main(args: "argparse.Namespace") -> int:  # noqa: F821
    """``tierstore plan --config FILE``: the plan of the config's example model (built on the meta device,
    so nothing is allocated), refused with the numbers when it does not fit."""
    import torch

    from runtime.api import _gpu_budget, resolve_device, resolve_plan
    from runtime.blocks import build_blocks
    from runtime.config import load_config
    from runtime.example_model import ExampleLM, ModelShape

    cfg = load_config(args.config)
    m = cfg.train.model
    with torch.device("meta"):
        model = ExampleLM(ModelShape(m.vocab_size, m.hidden_size, m.num_layers, m.num_heads, m.ffn_size, m.max_seq_len))
    blocks = build_blocks(model, cfg.blocks.min_block_size, list(cfg.blocks.modules) if cfg.blocks.modules else None)
    device = resolve_device(cfg)
    plan = resolve_plan(blocks, cfg, device).plan
    print(plan.table())
    check_plan(plan, _gpu_budget(cfg, device) if device.type == "cuda" else 1 << 62, cfg.tiers.nvme.path, cfg.tiers.nvme.budget)
    print("the plan fits this machine")
    return 0
