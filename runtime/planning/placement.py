"""Which state lives where: one function from (the model's blocks, the config, the device, the machine's rates) to
a placement and its memory plan, ``resolve_plan``: the one ``offload()`` applies and ``tierstore plan`` prints.

It resolves the config's homes (``runtime.planning.settings``), the ``auto`` placement knobs
(``runtime.planning.auto_placement``, from the ``Rates`` it is given: nothing here times anything), whether the
first step is measured first (``runtime.planning.measured_placement``), whether a compute-dtype copy of the
weights pays ([Note: compute-dtype copy under accumulation]), which moments spill to NVMe and whether updates get
pre-commit buffers (``runtime.planning.block_plan``). ``placement_at_reserve`` asks auto placement again for a
running session (after its measured first step, or for the profiler's advice) with what that session has fixed.
Leaves out: measuring the rates (``runtime.update.rates``), inspecting the user's module (the caller says whether its
layers can be recomputed) and allocating anything.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from runtime.config.loader import TierstoreConfig
from runtime.core.blocks import Block
from runtime.planning.auto_placement import Placement, PlacementInputs, Rates, choose_placement
from runtime.planning.block_plan import host_limit_nbytes, plan_fits, plan_for, plan_of, spill, within_limit
from runtime.planning.measured_placement import FIRST_STEP_NOTE, TRIAL_NOTE
from runtime.planning.memory_plan import Budgets, MemoryPlan, WeightSource, check_fits, gpu_budget_nbytes
from runtime.planning.moment_sizes import state_itemsize
from runtime.planning.settings import compute_itemsize, host_grad_dtype, resolve_homes, sums_on_host, waits_for_commit
from tierstore import TierName

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedPlan:
    """The placement a config resolves to for given blocks, and its memory plan."""

    homes: dict[str, TierName]  # kind -> home tier
    source: WeightSource  # where compute weights are fetched from
    spilled_blocks: frozenset[int]  # blocks whose moments live on NVMe although homes says host
    plan: MemoryPlan
    placement: Placement  # gpu_update_fraction, gpu_stream_fraction, keep_for_backward with `auto` resolved
    # The placement is the first step's: auto placement is asked again at its commit (runtime.planning.measured_placement).
    measured_first_step: bool = False


def rates_needed(cfg: TierstoreConfig, device: torch.device) -> bool:
    """True when the plan chooses something from the machine's rates: an ``auto`` placement knob on a GPU."""
    opt = cfg.optimizer
    return device.type == "cuda" and "auto" in (opt.gpu_update_fraction, opt.gpu_stream_fraction,
                                                 cfg.prefetch.keep_for_backward)


def _require_rates(cfg: TierstoreConfig, device: torch.device, rates: Rates | None) -> None:
    if rates is None and rates_needed(cfg, device):
        raise ValueError("auto placement on a GPU plans with the machine's rates: pass rates= "
                         "(runtime.update.rates.measure_rates times them)")


def plan_blocks(blocks: list[Block], cfg: TierstoreConfig, device: torch.device, *, rates: Rates | None,
                recomputable: bool = False) -> tuple[ResolvedPlan, Budgets]:
    """``resolve_plan`` put through every check that can refuse it before anything is allocated
    (``memory_plan.check_fits``); returns it with the budgets the store is built with."""
    resolved = resolve_plan(blocks, cfg, device, rates=rates, recomputable=recomputable)
    return resolved, check_fits(resolved.plan, cfg, device)


def resolve_placement(blocks: list[Block], cfg: TierstoreConfig, device: torch.device, homes: dict[str, TierName],
                      source: WeightSource, *, rates: Rates | None = None,
                      no_stream_reason: str | None = None) -> Placement:
    """``optimizer.gpu_update_fraction``, ``optimizer.gpu_stream_fraction`` and ``prefetch.keep_for_backward`` as
    numbers: explicit values as written, ``auto`` chosen by ``runtime.planning.auto_placement`` (0 on the CPU).
    ``rates``: the speeds to plan with on CUDA (needed where something is ``auto`` there: ``rates_needed``)."""
    opt, keep = cfg.optimizer, cfg.prefetch.keep_for_backward
    host_sums = sums_on_host(blocks, cfg, device)
    if "auto" not in (opt.gpu_update_fraction, opt.gpu_stream_fraction, keep):
        return Placement(float(opt.gpu_update_fraction), float(opt.gpu_stream_fraction), int(keep), host_sums=host_sums)
    _require_rates(cfg, device, rates)
    if device.type != "cuda":
        rates = None
    if no_stream_reason is None and TierName.NVME in (homes["master"], homes["exp_avg"]):
        no_stream_reason = "master or moments on nvme: streaming needs them in pinned host memory"
    itemsize = compute_itemsize(cfg)
    ordered = sorted(blocks, key=lambda b: b.index)  # forward order, as gpu_updated_blocks counts

    def gpu_plan_nbytes(updated: int, streamed: int) -> int:
        first = frozenset(b.index for b in ordered[:updated])
        return plan_of(blocks, cfg, homes, source, updated=first, streamed=streamed, host_sums=host_sums).gpu_nbytes

    inputs = PlacementInputs(block_numels=tuple(b.numel for b in ordered), gpu_budget_nbytes=gpu_budget_nbytes(cfg, device),
                             gpu_plan_nbytes=gpu_plan_nbytes, compute_itemsize=itemsize,
                             fetch_itemsize=4 if source is WeightSource.MASTER else itemsize,
                             grad_itemsize=host_grad_dtype(cfg, host_sums).itemsize,
                             weights_resident=source is WeightSource.RESIDENT, no_stream_reason=no_stream_reason,
                             updates_wait_for_commit=waits_for_commit(cfg),
                             state_itemsize=state_itemsize(opt.moment_dtype),
                             activation_reserve_nbytes=None if cfg.tiers.gpu.activation_reserve == "auto"
                             else int(cfg.tiers.gpu.activation_reserve))
    chosen = choose_placement(inputs, rates, update=opt.gpu_update_fraction, stream=opt.gpu_stream_fraction, keep=keep)
    return dataclasses.replace(chosen, host_sums=host_sums, rates=rates)


def resolve_plan(blocks: list[Block], cfg: TierstoreConfig, device: torch.device, *, rates: Rates | None = None,
                 recomputable: bool = False, weights_copy: bool = True) -> ResolvedPlan:
    """Homes, weight source, the ``auto`` placement knobs (``resolve_placement``) and the plan.
    ``placement.moments: auto`` with an NVMe path keeps the moments in pinned host memory as far as
    ``tiers.host.budget`` allows (``auto``: the RAM available now, less headroom) and spills blocks' moments to
    NVMe in ``spill_order``, only as many as needed. ``rates``: the machine's (``rates_needed`` says when they are
    used); ``recomputable``: the layers' forwards can be recomputed (``runtime.model.recompute.recompute_refusal``
    found nothing), so ``placement.activations: auto`` may try that after a measured first step; ``weights_copy``
    False: never a compute-dtype copy of the weights (the first step of a run whose plan keeps none)."""
    if cfg.optimizer.overlap != "exact":
        raise ValueError("optimizer.overlap: delayed is not implemented yet; use exact")
    _require_rates(cfg, device, rates)
    homes, source = resolve_homes(cfg)
    limit = host_limit_nbytes(cfg)
    placement, spilled_blocks, host_updated = _place_and_spill(blocks, cfg, device, homes, source, rates, limit)
    copy_note = None
    if weights_copy and copy_fetch_may_pay(cfg, device, source) and placement.gpu_update_fraction < 1:  # fetched
        copy, copy_note = _weights_copy(blocks, cfg, device, homes, rates, limit,
                                        master=(placement, spilled_blocks, host_updated))
        if copy is not None:
            source, (placement, spilled_blocks, host_updated) = WeightSource.WEIGHTS, copy
    if measures_first_step(cfg, device):
        first = _first_step_plan(blocks, cfg, device, rates, limit, homes, recomputable=recomputable,
                                 copy_now=source is WeightSource.WEIGHTS)
        if first is not None:
            return first
    if source is WeightSource.WEIGHTS and placement.gpu_stream_fraction:
        raise RuntimeError("a compute-dtype weights copy with streamed updates: a streamed update refreshes no host copy")
    if spilled_blocks:
        log.info("placement.moments: auto: the moments of %d of %d host-updated blocks go to NVMe", len(spilled_blocks),
                 host_updated)
    # Updates that wait for the commit run ahead into second buffers when the host has room for them; they are
    # the first thing given up (before spilling moments to disk): without them a step is only slower.
    spares = not spilled_blocks and waits_for_commit(cfg) and plan_fits(blocks, cfg, homes, source, placement, limit,
                                                                        spares=True)
    plan = plan_for(blocks, cfg, homes, source, len(spilled_blocks), spares, placement=placement)
    plan.notes = (*placement.notes, *((copy_note,) if copy_note is not None else ()), *_accumulate_note(cfg, placement))
    return ResolvedPlan(homes, source, spilled_blocks, plan, placement)


def _accumulate_note(cfg: TierstoreConfig, placement: Placement) -> tuple[str, ...]:
    """The plan's line saying where ``optimizer.accumulate_on: auto`` sums the micro-batches' gradients, and why."""
    if cfg.optimizer.accumulate_on != "auto" or cfg.optimizer.accumulation_steps == 1:
        return ()
    return ("optimizer.accumulate_on: auto -> " + (
        "host (the model's gradients take more than a quarter of the GPU budget)" if placement.host_sums
        else "gpu (the model's gradients fit a quarter of the GPU budget)"),)


def measures_first_step(cfg: TierstoreConfig, device: torch.device) -> bool:
    """True when auto placement waits for the first step's measured peak (``runtime.planning.measured_placement``): the
    update fraction and the activation reserve are both ``auto``, on a GPU."""
    return (device.type == "cuda" and cfg.optimizer.gpu_update_fraction == "auto"
            and cfg.tiers.gpu.activation_reserve == "auto")


def first_step_config(cfg: TierstoreConfig) -> TierstoreConfig:
    """``cfg`` as the first step of ``measures_first_step`` runs it: every update on the CPU, nothing streamed, and
    no weights kept for backward unless the config sets an amount (the plan's smallest GPU footprint)."""
    opt, prefetch = cfg.optimizer, cfg.prefetch
    opt = dataclasses.replace(opt, gpu_update_fraction=0.0,
                              gpu_stream_fraction=0.0 if opt.gpu_stream_fraction == "auto" else opt.gpu_stream_fraction)
    keep = 0 if prefetch.keep_for_backward == "auto" else prefetch.keep_for_backward
    return dataclasses.replace(cfg, optimizer=opt, prefetch=dataclasses.replace(prefetch, keep_for_backward=keep))


def _first_step_plan(blocks: list[Block], cfg: TierstoreConfig, device: torch.device, rates: Rates | None, limit: int,
                     homes: dict[str, TierName], *, recomputable: bool, copy_now: bool) -> ResolvedPlan | None:
    """The plan of ``measures_first_step``'s first step (``first_step_config``), or None where it is not taken.
    ``homes``: cfg's (``resolve_homes``); ``copy_now``: the plan chosen now keeps a compute-dtype copy of the weights.

    A first step fetching the master would rule the copy out, and one keeping it would rule out streaming after it
    (adopting a placement with the copy works, tests/integration/test_weights_copy.py; not measured on a GPU yet).
    So where the plan chosen now keeps the copy, the first step is measured only where it spills moments within the
    host limit (a spilling plan never takes the copy: the host room of the blocks the measured placement moves to
    the GPU brings spilled moments back, block_plan.spilled_after, Controller.adopt_placement); where it keeps none
    (the copy cannot pay, or does not fit beside the rest: int8 moments of the 8B scenario at 64 GiB), the first
    step fetches the master too and is measured where it spills within the limit or fits with its pre-commit
    buffers."""
    first_cfg = first_step_config(cfg)
    first = resolve_plan(blocks, first_cfg, device, rates=rates, weights_copy=copy_now)
    if first.source is WeightSource.WEIGHTS:  # the first step would keep the copy: chosen now, as the plan keeps it
        return None
    spills = first.spilled_blocks and first.source is WeightSource.MASTER and within_limit(first.plan, cfg, limit)
    if not spills and (copy_now or not plan_fits(
            blocks, first_cfg, homes, first.source, first.placement, limit, spares=first.plan.pre_commit_buffers)):
        return None
    trial_note = (TRIAL_NOTE,) if cfg.placement.activations == "auto" and recomputable else ()
    first.plan.notes = (FIRST_STEP_NOTE, *trial_note, *first.plan.notes)
    placement = dataclasses.replace(first.placement, rates=rates, notes=(FIRST_STEP_NOTE,))
    return dataclasses.replace(first, placement=placement, measured_first_step=True)


def _weights_copy(blocks: list[Block], cfg: TierstoreConfig, device: torch.device, homes: dict[str, TierName],
                  rates: Rates | None, limit: int, *, master: tuple[Placement, frozenset[int], int]
                  ) -> tuple[tuple[Placement, frozenset[int], int] | None, str]:
    """Whether the plan keeps a compute-dtype copy of the weights instead of fetching the master
    ([Note: compute-dtype copy under accumulation]): the copy's (placement, spilled blocks, host-updated count)
    when it costs nothing else, else None; and the plan's note saying which and why. ``master``: the same for
    fetching the master."""
    placement, spilled_blocks, _ = master
    # The copy must cost nothing else: no moments spilled, no streaming given up (a streamed block's update
    # refreshes no host copy), no pre-commit buffers lost (clipped steps would wait for the norm again).
    if spilled_blocks:
        why = "the moments already spill to NVMe, and the copy would spill more"
    elif placement.gpu_stream_fraction:
        why = "updates are streamed to the GPU, and a streamed update refreshes no host copy"
    else:
        copy = _place_and_spill(blocks, cfg, device, homes, WeightSource.WEIGHTS, rates, limit)
        copy_placement, copy_spilled, _ = copy

        def fits(which: WeightSource, chosen: Placement, spares: bool = False) -> bool:
            return plan_fits(blocks, cfg, homes, which, chosen, limit, spares=spares)

        if copy_spilled or copy_placement.gpu_stream_fraction or not fits(WeightSource.WEIGHTS, copy_placement):
            why = "it would not fit beside the rest without spilling moments to NVMe"
        elif (waits_for_commit(cfg) and fits(WeightSource.MASTER, placement, spares=True)
              and not fits(WeightSource.WEIGHTS, copy_placement, spares=True)):
            why = "it would take the room of the pre-commit buffers that let clipped steps update early"
        else:
            return copy, (f"placement.weights: a {cfg.dtype} copy in pinned memory: {cfg.optimizer.accumulation_steps} "
                          "micro-batches a step fetch half the bytes of the fp32 master, and it fits beside the rest")
    return None, f"placement.weights: fetched from the fp32 master, not a {cfg.dtype} copy in pinned memory: {why}"


# [Note: compute-dtype copy under accumulation]
# With the master in pinned memory the GPU fetches the fp32 master and casts it (no host pass, no host bytes). Under
# gradient accumulation each micro-batch fetches every block again (forward, and backward for what is not kept), so
# a step moves 4 bytes a parameter that many times; a compute-dtype copy halves that for one CPU cast a step (the
# optimizer worker refreshes the copy after each update; ``runtime.update.worker``). The weights are the same bits:
# fp32 -> bf16 rounds to nearest even on either side. The copy costs 2 bytes a parameter of pinned memory, so the
# plan takes it only when it costs nothing else (``resolve_plan``). On an H100 at 14 layers of the 8B scenario
# (4.10B parameters, 16 micro-batches a step) the fp32 fetches were 389 GB a step at 46 GB/s.
def copy_fetch_may_pay(cfg: TierstoreConfig, device: torch.device, source: WeightSource) -> bool:
    """True when a compute-dtype copy of the weights in pinned memory may be worth its host bytes: a GPU fetching
    the fp32 master (``placement.weights`` host or auto) of 2-byte compute weights once per micro-batch of an
    accumulated step (see [Note: compute-dtype copy under accumulation])."""
    return (device.type == "cuda" and source is WeightSource.MASTER and cfg.dtype in ("bf16", "fp16")
            and cfg.optimizer.accumulation_steps > 1)


def _place_and_spill(blocks: list[Block], cfg: TierstoreConfig, device: torch.device, homes: dict[str, TierName],
                     source: WeightSource, rates: Rates | None,
                     limit: int) -> tuple[Placement, frozenset[int], int]:
    """Auto placement for ``source`` and the blocks whose moments then spill to NVMe (``block_plan.spill``);
    streaming given up first when the plan would not fit otherwise. Returns (placement, spilled blocks,
    host-updated count)."""
    placement = resolve_placement(blocks, cfg, device, homes, source, rates=rates)
    spilled_blocks, host_updated, fits = spill(blocks, cfg, homes, source, placement, limit)
    if not fits and cfg.optimizer.gpu_stream_fraction == "auto" and placement.gpu_stream_fraction > 0:
        # Streamed blocks keep their moments in pinned memory: give them up before refusing the plan.
        placement = resolve_placement(blocks, cfg, device, homes, source, rates=rates, no_stream_reason=(
            "host RAM holds the moments of no streamed block beside the rest"))
        spilled_blocks, host_updated, fits = spill(blocks, cfg, homes, source, placement, limit)
    return placement, spilled_blocks, host_updated


@dataclass(frozen=True)
class InForce:
    """What a running session's placement has fixed, which auto placement asked again keeps."""

    gpu_budget_nbytes: int  # the GPU budget the store has
    source: WeightSource  # where its weights are fetched from: a copy the plan chose stays chosen
    spills: bool  # some blocks' moments live on NVMe
    # Some update is streamed, or may be (the measured first step's plan kept every moment in pinned memory). A
    # session that streams nothing keeps streaming nothing: its plan may have given streaming up for host memory,
    # which asking again does not re-check.
    streams: bool
    rates: Rates | None  # the rates it was placed with: never timed again mid-training


def placement_at_reserve(blocks: list[Block], cfg: TierstoreConfig, device: torch.device, in_force: InForce,
                         reserve_nbytes: int) -> Placement:
    """What auto placement would choose for a running session's blocks and config with
    ``tiers.gpu.activation_reserve`` at ``reserve_nbytes``, keeping what ``in_force`` says it has fixed (the
    measured first step and the profiler's advice ask)."""
    gpu = dataclasses.replace(cfg.tiers.gpu, activation_reserve=int(reserve_nbytes), budget=in_force.gpu_budget_nbytes)
    cfg = dataclasses.replace(cfg, tiers=dataclasses.replace(cfg.tiers, gpu=gpu))
    homes, _ = resolve_homes(cfg)
    no_stream = None
    if in_force.spills:  # a streamed block's update copies its moments from pinned memory
        no_stream = "moments spill to NVMe: the host room freed by blocks moved to the GPU brings them back first"
    elif not in_force.streams:
        no_stream = ("the plan keeps a compute-dtype copy of the weights, which a streamed update would not refresh"
                     if in_force.source is WeightSource.WEIGHTS else "this session streams nothing")
    return resolve_placement(blocks, cfg, device, homes, in_force.source, rates=in_force.rates, no_stream_reason=no_stream)


def adopted_plan(blocks: list[Block], cfg: TierstoreConfig, homes: dict[str, TierName], source: WeightSource,
                 placement: Placement, *, spilled: int, spares: bool) -> MemoryPlan:
    """The memory plan of a session that adopted ``placement`` after its measured first step, ``spilled`` blocks'
    moments still on NVMe and its pre-commit buffers (``spares``) as they were; its notes say how it was chosen."""
    plan = plan_for(blocks, cfg, homes, source, spilled, spares, placement=placement)
    plan.notes = (FIRST_STEP_NOTE, *placement.notes)
    return plan
