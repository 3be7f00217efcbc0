"""The memory plan of a model's blocks under a resolved placement, and what of it the host can hold.

``plan_for`` turns blocks, a config and a ``Placement`` into ``memory_plan.make_plan``'s numbers; the rest answers
whether that plan fits the host: the limit (``tiers.host.budget``, or the RAM available), and under
``placement.moments: auto`` which host-updated blocks spill their moments to NVMe for it to fit (``spill``).
Leaves out: choosing the placement (``runtime.planning.placement``) and refusing a plan (``memory_plan.check_fits``).
"""

from __future__ import annotations

from runtime.config.loader import TierstoreConfig
from runtime.core.blocks import Block
from runtime.planning.auto_placement import Placement, gpu_streamed_blocks, gpu_updated_blocks
from runtime.planning.hostmem import host_memory
from runtime.planning.memory_plan import MemoryPlan, WeightSource, make_plan, planned_ram_nbytes, spill_moments, spill_order
from runtime.planning.moment_sizes import stored_moment_nbytes
from runtime.planning.settings import compute_itemsize, host_grad_dtype
from tierstore import TierName


def plan_for(blocks: list[Block], cfg: TierstoreConfig, homes: dict[str, TierName], source: WeightSource,
             spilled: int = 0, spares: bool = False, *, placement: Placement) -> MemoryPlan:
    """The memory plan of these blocks under this config and resolved ``placement`` (nothing allocated);
    ``spilled``: how many of the last host-updated blocks keep their moments on NVMe, ``spares``: second state
    buffers for updates that run before the commit (see ``runtime.planning.placement.resolve_plan``)."""
    gpu_updated = gpu_updated_blocks(blocks, placement.gpu_update_fraction)
    streamed = len(gpu_streamed_blocks(blocks, placement.gpu_update_fraction, placement.gpu_stream_fraction))
    return plan_of(blocks, cfg, homes, source, updated=gpu_updated, streamed=streamed, spilled=spilled,
                   spares=spares, host_sums=placement.host_sums)


def plan_of(blocks: list[Block], cfg: TierstoreConfig, homes: dict[str, TierName], source: WeightSource, *,
            updated: frozenset[int], streamed: int, spilled: int = 0, spares: bool = False,
            host_sums: bool = False) -> MemoryPlan:
    """The memory plan with the blocks ``updated`` on the GPU and the ``streamed`` first of the others streamed
    (``plan_for`` with the counts given, as auto placement tries them)."""
    host_updated = [b for b in blocks if b.index not in updated]
    by_index = {b.index: b for b in blocks}  # blocks may be some of the model's (one rank's: runtime.planning.ownership)
    moment_dtype = cfg.optimizer.moment_dtype
    return make_plan([b.numel for b in host_updated], {k: v.value for k, v in homes.items()},
                     source.value, compute_itemsize(cfg), cfg.prefetch.depth,
                     cfg.optimizer.accumulation_steps, gpu_updated_numels=[by_index[i].numel for i in sorted(updated)],
                     spilled=spilled, streamed=streamed, spares=spares, host_sums=host_sums,
                     grad_itemsize=host_grad_dtype(cfg, host_sums).itemsize, moment_dtype=moment_dtype,
                     moment_nbytes=[stored_moment_nbytes(moment_dtype, [slot.numel for slot in b.slots]) for b in host_updated],
                     gpu_moment_nbytes=[stored_moment_nbytes(moment_dtype, [slot.numel for slot in by_index[i].slots])
                                        for i in sorted(updated)])


def host_limit_nbytes(cfg: TierstoreConfig) -> int:
    """What the plan's host memory must fit: ``tiers.host.budget``, or under ``auto`` the RAM available now."""
    return host_memory().usable_nbytes if cfg.tiers.host.budget == "auto" else int(cfg.tiers.host.budget)


def plan_fits(blocks: list[Block], cfg: TierstoreConfig, homes: dict[str, TierName], source: WeightSource,
              placement: Placement, limit: int, *, spares: bool = False) -> bool:
    """True when the plan with nothing spilled (and ``spares``: with pre-commit buffers) stays within ``limit``:
    its pinned bytes under an explicit ``tiers.host.budget`` (the pool's size, what ``spill_moments`` fills), its
    RAM (pinned bytes and swap files on tmpfs) under ``auto`` (the RAM available)."""
    return within_limit(plan_for(blocks, cfg, homes, source, spares=spares, placement=placement), cfg, limit)


def within_limit(plan: MemoryPlan, cfg: TierstoreConfig, limit: int) -> bool:
    """True when the plan stays within ``limit``: its pinned bytes under an explicit ``tiers.host.budget``, its RAM
    (pinned bytes and swap files on tmpfs) under ``auto``."""
    used = planned_ram_nbytes(plan, cfg.tiers.nvme.path) if cfg.tiers.host.budget == "auto" else plan.host_nbytes
    return used <= limit


def spill(blocks: list[Block], cfg: TierstoreConfig, homes: dict[str, TierName], source: WeightSource,
          placement: Placement, limit: int) -> tuple[frozenset[int], int, bool]:
    """The host-updated blocks that spill their moments to NVMe (``placement.moments: auto``, in ``spill_order``) for
    the plan's pinned memory to fit ``limit``, how many blocks are host-updated, and whether the plan then fits."""
    gpu_updated = gpu_updated_blocks(blocks, placement.gpu_update_fraction)
    host_updated = [b.index for b in blocks if b.index not in gpu_updated]
    if not (cfg.placement.moments == "auto" and cfg.tiers.nvme.path is not None and homes["exp_avg"] is TierName.HOST):
        return frozenset(), len(host_updated), True
    # Streamed blocks (the first host-updated ones) copy their moments from pinned memory: never spilled.
    streamed = gpu_streamed_blocks(blocks, placement.gpu_update_fraction, placement.gpu_stream_fraction)
    spillable = len(host_updated) - len(streamed)

    def make(count: int) -> MemoryPlan:
        return plan_for(blocks, cfg, homes, source, count, placement=placement)

    spilled = spill_moments(make, spillable, limit)
    numels = {b.index: b.numel for b in blocks}
    order = spill_order([numels[i] for i in host_updated], len(streamed))
    spilled_blocks = frozenset(host_updated[p] for p in order[:spilled])
    return spilled_blocks, len(host_updated), spilled < spillable or make(spilled).host_nbytes <= limit


def spilled_after(blocks: list[Block], cfg: TierstoreConfig, homes: dict[str, TierName], source: WeightSource,
                  spilled_blocks: frozenset[int], placement: Placement, host_capacity_nbytes: int) -> frozenset[int]:
    """The blocks whose moments stay on NVMe once ``placement`` is adopted by a session that spills
    ``spilled_blocks`` now: of those, the fewest (in ``spill_order``) for its plan to fit the pinned arena the
    session has (``host_capacity_nbytes``); the host room of the blocks it moves to the GPU brings the others back.
    A session whose master lives on NVMe keeps its spill (the masters' staging room is taken from the same arena)."""
    if not spilled_blocks or homes["master"] is not TierName.HOST:
        return spilled_blocks
    target, _, _ = spill(blocks, cfg, homes, source, placement, host_capacity_nbytes)
    return spilled_blocks & target
