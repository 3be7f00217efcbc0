"""Advice: concrete config changes that would reduce the measured stalls, each with its predicted effect.

Every prediction is an upper bound built from figures of the same profile (steady-state means per step):
a change can at most remove the waiting it targets. The rules, by cause of the wait:

- prefetch misses (fetch from host): fetch further ahead -- ``prefetch.depth``, and ``prefetch.budget``
  when the deeper window's bytes would not fit in it;
- fetches staged from NVMe: more ``tiers.nvme.io_threads`` while the disk is below its ceiling, else keep
  the weights' source on host;
- GPU budget full (a refused prefetch): more ``tiers.gpu.budget``;
- Adam not done: take the worker's input waits away (moments from NVMe to host when RAM has room; more IO
  threads while NVMe reads are below their ceiling), run the first blocks' update on the GPU
  (``optimizer.gpu_update_fraction``: those are the updates the CPU cannot hide), and amortise Adam over more
  tokens (``optimizer.accumulation_steps``).
- the micro-batch (``micro_batch_advice``): where every micro-batch fetches the weights again and that traffic
  holds the step, more tokens per micro-batch divide it; the item names what lets a micro-batch grow (activation
  checkpointing, a chunked loss for a large vocabulary) and, on a GPU whose peak is known, whether it must first.
  On a GPU, the steps' measured peak bounds what may move there: with a hand-set fraction, the blocks whose
  device-side state fits the memory the peak left unused, less ``GPU_MARGIN`` of the budget; under ``auto``
  placement, the activation reserve the peak supports and what auto placement chooses with it
  (``runtime.planning.peak_hint.reserve_probe`` asks it), when that is more blocks on the GPU.
"""

from __future__ import annotations

import math
from typing import Any

from runtime.core.events import STALL_CAPACITY, STALL_FETCH_HOST, STALL_FETCH_NVME, STALL_GRAD_SUM, STALL_UPDATE
from runtime.planning.moment_sizes import state_itemsize
from runtime.planning.peak_hint import GPU_MARGIN, beyond_plan
from runtime.profiler.names import device_word, on_gpu
from runtime.profiler.shares import share_text

MIN_STALL_S = 1e-3  # waits below this per step are noise
MIN_STALL_SHARE = 0.02  # ... and so are waits below this share of the step
RAM_MARGIN = 1.25  # moving state to pinned memory wants this much more free RAM than it takes
READ_SATURATED = 0.8  # NVMe reads at this share of the ceiling gain nothing from more threads
# The weights' copies to the device busy for at least this share of the step: their traffic is what the step is
# made of, and fewer micro-batches (each fetching every weight) take it away.
FETCH_BOUND_SHARE = 0.5
CHUNKED_LOSS = ("a chunked loss for a large vocabulary, whose logits hold the micro-batch down (HF Trainer: "
                "TrainingArguments(use_liger_kernel=True); without Liger: runtime.integrations.hf_loss.use_chunked_loss)")
WEIGHTS_COPY_ITEMSIZE = 2  # with a compute-dtype copy of its weights (weight source "weights"), that copy


def host_state_itemsize(cfg: dict[str, Any], weights_copy: bool = True) -> float:
    """Pinned bytes a parameter of a host-updated block holds: its state (the moments as ``optimizer.moment_dtype``
    stores them; fp32 in profiles that predate it) and its host gradient (of ``optimizer.host_grad_dtype``; fp32 in
    profiles that predate it), and the weights copy when there is one and ``weights_copy``."""
    copy = WEIGHTS_COPY_ITEMSIZE if weights_copy and cfg.get("weight_source") == "weights" else 0
    return _state_itemsize(cfg) + int(cfg.get("host_grad_itemsize", 4)) + copy


def _state_itemsize(cfg: dict[str, Any]) -> float:
    """Bytes a parameter of master and moments, as the profiled run stored its moments."""
    return state_itemsize(str(cfg.get("moment_dtype", "fp32")))


def size_text(nbytes: float) -> str:
    """A byte count for a person (binary units)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def advise(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The advice for a summary (see the module doc), largest predicted saving first. Each item has
    ``change`` (the config edit), ``saves_s`` (the most it removes per step), ``measured_s`` (the wait it
    targets), and ``text`` (one line for a person)."""
    steady = summary.get("steady") or {}
    if not steady.get("steps"):
        return []
    cfg = summary.get("config") or {}
    step_s = steady["step_s"]
    waits = {c: steady["stall_s"].get(c, 0.0) + steady["device_wait_s"].get(c, 0.0) for c in steady["stall_s"]}
    total = sum(waits.values())
    threshold = max(MIN_STALL_S, MIN_STALL_SHARE * step_s)
    items: list[dict[str, Any]] = []

    def add(change: str, saves: float, measured: float, why: str) -> None:
        for item in items:  # two causes may ask for the same change: one item, the savings added
            if item["change"] == change:
                item["saves_s"] = min(total, item["saves_s"] + saves)
                item["measured_s"] += measured
                item["text"] = _text(change, item["saves_s"], total, item["why"] + "; " + why)
                item["why"] += "; " + why
                return
        items.append({"change": change, "saves_s": saves, "measured_s": measured, "why": why,
                      "text": _text(change, saves, total, why)})

    if waits.get(STALL_FETCH_HOST, 0.0) >= threshold:
        _prefetch_advice(summary, cfg, waits[STALL_FETCH_HOST], steady, add)
    if waits.get(STALL_FETCH_NVME, 0.0) >= threshold:
        _nvme_fetch_advice(summary, cfg, waits[STALL_FETCH_NVME], add)
    if waits.get(STALL_CAPACITY, 0.0) >= threshold:
        largest = max((b["weight_nbytes"] for b in summary.get("blocks") or []), default=0)
        budget = cfg.get("gpu_budget_nbytes", 0)
        need = largest * max(1, cfg.get("prefetch_depth", 1))
        add(f"raise tiers.gpu.budget from {size_text(budget)} to {size_text(budget + need)} (or lower prefetch.depth "
            "so prefetches fit)", waits[STALL_CAPACITY], waits[STALL_CAPACITY],
            f"{waits[STALL_CAPACITY]:.3f} s/step waited on fetches whose prefetch the full "
            f"{device_word(summary.get('device_type'))} budget refused")
    if waits.get(STALL_UPDATE, 0.0) >= threshold:
        _update_advice(summary, cfg, waits[STALL_UPDATE], steady, threshold, add)
    if waits.get(STALL_GRAD_SUM, 0.0) >= threshold:
        _grad_sum_advice(summary, cfg, waits[STALL_GRAD_SUM], add)
    micro_batch_advice(summary, cfg, waits, steady, threshold, add)
    if not items:
        share = total / step_s if step_s > 0 else 0.0
        return [{"change": "none", "saves_s": 0.0, "measured_s": total, "why": "stalls are small",
                 "text": f"no change needed: the training thread waited {total:.3f} s/step ({share:.0%} of the step)"}]
    return sorted(items, key=lambda item: -item["saves_s"])


def _text(change: str, saves: float, total: float, why: str) -> str:
    if saves <= 0.0:
        return f"{change}: would remove nothing of the {total:.3f} s/step the training thread waited ({why})"
    return f"{change}: would remove up to {saves:.3f} s/step of the {total:.3f} s/step the training thread waited ({why})"


def _grad_sum_advice(summary: dict[str, Any], cfg: dict[str, Any], wait: float, add: Any) -> None:
    """The backward waited for a host-sum staging buffer: a larger micro-batch (fewer of them a step) sends fewer
    gradients to the host. On a GPU whose peak is known it must fit: a micro-batch twice as large needs about the
    peak's bytes beyond the plan (``runtime.planning.peak_hint.beyond_plan``: its activations) once more, and where the peak
    left less room than that the item says so and promises nothing (the 8B scenario: 4.8 GiB of activations, 2 GiB
    left under the 24 GiB cap) instead of naming a change that runs out of memory."""
    why = f"{wait:.3f} s/step the backward waited for the host gradient sums (optimizer.accumulate_on: host) to free a buffer"
    if on_gpu(summary.get("device_type")):  # on a CPU the host time is the device's: nothing is queued behind it
        why += ("; host time: the GPU may still be working through what was queued, so the step gains less when the "
                "sums are not what holds it")
    room, peak = _room(summary, cfg), (summary.get("memory") or {}).get("gpu_peak_nbytes")
    if room is not None and peak and cfg.get("gpu_plan_nbytes"):
        activations = beyond_plan(cfg, int(peak))
        if activations > room:
            add("keep the micro-batch size (twice as large does not fit the GPU budget)", 0.0, wait,
                f"{why}; twice the micro-batch needs about {size_text(activations)} more for its activations (the "
                f"peak beyond the plan) and the step's peak left {size_text(room)} free beside a {GPU_MARGIN:.0%} margin")
            return
    add("raise the micro-batch size and lower optimizer.accumulation_steps to match (each micro-batch's gradient "
        "is summed on the host once, whatever its tokens)", wait, wait, why)


def micro_batch_advice(summary: dict[str, Any], cfg: dict[str, Any], waits: dict[str, float], steady: dict[str, Any],
                       threshold: float, add: Any) -> None:
    """The micro-batch limits the run: with ``accumulation_steps`` micro-batches a step, each fetches every
    streamed weight again (forward and backward), and where those copies keep the link busy for
    ``FETCH_BOUND_SHARE`` of the step and the training thread waits on fetches, twice the tokens per micro-batch
    (half as many micro-batches) halve that traffic. It removes at most the fetch waits, and at most half the link's
    busy time. What lets a micro-batch grow is named: activation checkpointing where it is off, a chunked loss; on a
    GPU whose peak is known, whether twice the activations fit what the peak left (``_room``) or that room comes
    first. Nothing with resident weights (never fetched) or one micro-batch a step (the step's tokens would grow)."""
    accumulation = int(cfg.get("accumulation_steps", 1))
    fetch_wait = sum(waits.get(c, 0.0) for c in (STALL_FETCH_HOST, STALL_FETCH_NVME, STALL_CAPACITY))
    h2d = (steady.get("paths") or {}).get("h2d") or {}
    busy_s, step_s = float(h2d.get("busy_s") or 0.0), float(steady.get("step_s") or 0.0)
    if (accumulation < 2 or cfg.get("weight_source") == "resident" or fetch_wait < threshold
            or busy_s < FETCH_BOUND_SHARE * step_s):
        return
    device_type = summary.get("device_type")
    why = (f"each of the {accumulation} micro-batches fetches the weights again: {size_text(h2d.get('nbytes', 0))} a step "
           f"to the {device_word(device_type)}, which kept the copies busy {busy_s:.3f} s of the {step_s:.3f} s step, and "
           f"the training thread waited {fetch_wait:.3f} s/step on fetches; more tokens per micro-batch divide that "
           "traffic")
    grow = [] if cfg.get("activations_recomputed") else ["activation checkpointing (placement.activations: recompute)"]
    grow.append(CHUNKED_LOSS)
    room, peak = _room(summary, cfg), (summary.get("memory") or {}).get("gpu_peak_nbytes")
    if room is not None and peak and cfg.get("gpu_plan_nbytes"):
        activations = beyond_plan(cfg, int(peak))
        if activations > room:
            why += (f"; twice the micro-batch needs about {size_text(activations)} more for its activations and the "
                    f"step's peak left {size_text(room)} free beside a {GPU_MARGIN:.0%} margin: make room first with "
                    + " or ".join(grow))
        else:
            why += f"; twice its activations (about {size_text(activations)} more) fit what the step's peak left"
    else:
        why += "; where a larger micro-batch does not fit, it grows with " + " or ".join(grow)
    add(f"double the micro-batch and lower optimizer.accumulation_steps from {accumulation} to {max(1, accumulation // 2)} "
        "(the micro-batch limits this run)", min(fetch_wait, busy_s / 2), fetch_wait, why)


def _prefetch_advice(summary: dict[str, Any], cfg: dict[str, Any], wait: float, steady: dict[str, Any], add: Any) -> None:
    depth = int(cfg.get("prefetch_depth", 0))
    new_depth = min(64, max(2, depth + 2, depth * 2))
    weights = sorted((b["weight_nbytes"] for b in summary.get("blocks") or [] if not b.get("gpu_updated")), reverse=True)
    need = sum(weights[:new_depth])
    budget = int(cfg.get("prefetch_budget_nbytes", 0))
    change = f"raise prefetch.depth from {depth} to {new_depth}"
    if need > budget:
        change += f" and prefetch.budget from {size_text(budget)} to {size_text(need)}"
    add(change, wait, wait, f"prefetch misses: hit rate {steady['hit_rate']:.0%}, {wait:.3f} s/step fetching on demand")


def _nvme_fetch_advice(summary: dict[str, Any], cfg: dict[str, Any], wait: float, add: Any) -> None:
    read = (summary.get("totals") or {}).get("paths", {}).get("read", {})
    saturated = read.get("of_ceiling") is not None and read["of_ceiling"] >= READ_SATURATED
    why = f"{wait:.3f} s/step waited on weights staged from NVMe"
    if saturated:
        add("keep the weights' source on host (placement.master: host, or placement.weights: host)", wait, wait,
            why + f"; NVMe reads already at {share_text(read['of_ceiling'])} of the ceiling")
    else:
        threads = int(cfg.get("io_threads", 4))
        add(f"raise tiers.nvme.io_threads from {threads} to {min(64, threads * 2)}", wait, wait, why)


def _update_advice(summary: dict[str, Any], cfg: dict[str, Any], wait: float, steady: dict[str, Any], threshold: float,
                   add: Any) -> None:
    homes = cfg.get("homes") or {}
    inputs = steady.get("adam_wait_inputs_s", 0.0)
    if inputs >= threshold and any("nvme" in str(homes.get(kind)) for kind in ("exp_avg", "master")):
        memory = summary.get("memory") or {}
        need = memory.get("moments_offloaded_nbytes", 0)
        available = memory.get("host_available_nbytes", 0)
        why = f"Adam waited {inputs:.3f} s/step for its inputs from NVMe"
        if homes.get("exp_avg") == "nvme" and need and available >= RAM_MARGIN * need:
            add(f"move placement.moments from nvme to host (needs {size_text(need)} more pinned memory; "
                f"{size_text(available)} of RAM was free)", min(wait, inputs), wait, why)
        elif homes.get("exp_avg") == "host+nvme" and need and available >= RAM_MARGIN * need:
            add(f"raise tiers.host.budget by {size_text(need)} (placement.moments: auto then keeps every block's "
                f"moments in pinned memory; {size_text(available)} of RAM was free)", min(wait, inputs), wait, why)
        if cfg.get("moment_dtype", "fp32") == "fp32" and need:
            # Half the bytes of every moment read and written; a spill shrinks (or ends) as well.
            add("set optimizer.moment_dtype: bf16 (the moments in half the bytes on NVMe and in RAM, int8 in a "
                "quarter; approximate: docs/user-guide.md, Compact Adam moments)", min(wait, inputs / 2), wait,
                why + f", {size_text(need)} of fp32 moments")
        of_ceiling = (summary.get("totals") or {}).get("paths", {}).get("read", {}).get("of_ceiling")
        if of_ceiling is None or of_ceiling < READ_SATURATED:
            # Reads at the ceiling would take of_ceiling of the time they take now.
            saves = min(wait, inputs * (1.0 - of_ceiling)) if of_ceiling is not None else min(wait, inputs)
            where = f"; NVMe reads at {share_text(of_ceiling)} of the ceiling" if of_ceiling is not None else ""
            threads = int(cfg.get("io_threads", 4))
            add(f"raise tiers.nvme.io_threads from {threads} to {min(64, threads * 2)}", saves, wait, why + where)
    _gpu_update_advice(summary, cfg, wait, steady, add)
    adam_s, compute_s = steady.get("adam_s", 0.0), steady.get("compute_s", 0.0)
    if adam_s > compute_s > 0:
        accumulation = int(cfg.get("accumulation_steps", 1))
        add(f"raise optimizer.accumulation_steps from {accumulation} to {2 * accumulation} (more tokens per update)",
            wait / 2, wait, f"CPU Adam takes {adam_s:.3f} s per update against {compute_s:.3f} s of forward+backward; "
            "per token the update wait halves")


def _gpu_update_advice(summary: dict[str, Any], cfg: dict[str, Any], wait: float, steady: dict[str, Any], add: Any) -> None:
    """The smallest prefix of blocks (forward order) holding most of the update stall goes to the GPU; on a GPU
    whose peak is known, only as much of it as fits beside that peak (``_room``). Under ``auto`` placement the
    change is the activation reserve (``_reserve_advice``)."""
    blocks = sorted(summary.get("blocks") or [], key=lambda b: b["index"])
    by_block = {int(k): v for k, v in (steady.get("update_stall_by_block") or {}).items()}
    stalled = sum(by_block.values())
    if not blocks or stalled <= 0:
        return
    covered, last = 0.0, -1
    for b in blocks:
        covered += by_block.get(b["index"], 0.0)
        last = b["index"]
        if covered >= 0.8 * stalled:
            break
    if summary.get("device_type") == "cuda" and cfg.get("gpu_update_fraction_auto"):
        _reserve_advice(summary, cfg, wait, steady, add, blocks, by_block)  # auto placement chooses the blocks
        return
    room = _room(summary, cfg)
    prefix = [b for b in blocks if b["index"] <= last]
    if room is not None:
        prefix = _fitting(blocks, room, _state_itemsize(cfg))
        if not any(not b.get("gpu_updated") for b in prefix):
            return
        last = prefix[-1]["index"]
        covered = sum(by_block.get(b["index"], 0.0) for b in prefix)
    total_numel = sum(b["numel"] for b in blocks)
    # Without a peak, a round figure; with one, the prefix's own share (rounded up at the fourth digit, so that
    # runtime.planning.auto_placement.gpu_updated_blocks selects the prefix and not a block that does not fit).
    digits = 20 if room is None else 10_000
    fraction = math.ceil(sum(b["numel"] for b in prefix) / total_numel * digits) / digits
    current = float(cfg.get("gpu_update_fraction", 0.0))
    if fraction <= current:
        return
    extra = sum(_device_nbytes(b, _state_itemsize(cfg)) for b in prefix if not b.get("gpu_updated"))
    saves = min(wait, covered + _spill_saved(summary, steady, prefix))
    device_type = summary.get("device_type")
    note = "" if on_gpu(device_type) else "; on this CPU-only run the device update runs on the CPU too, beside the worker"
    left = f"; the step's peak left {size_text(room)} free beside a {GPU_MARGIN:.0%} margin" if room is not None else ""
    shown = (lambda x: f"{x:.2f}") if room is None else (lambda x: f"{x:.4f}")
    add(f"raise optimizer.gpu_update_fraction from {shown(current)} to {shown(fraction)} (needs about {size_text(extra)} "
        f"more {device_word(device_type)} memory{left})", saves, wait,
        f"blocks 0..{last} waited {covered:.3f} s/step for their CPU update: the first blocks' updates finish last and "
        f"are needed first{note}")


def _reserve_advice(summary: dict[str, Any], cfg: dict[str, Any], wait: float, steady: dict[str, Any], add: Any,
                    blocks: list[dict[str, Any]], by_block: dict[int, float]) -> None:
    """Auto placement reserved more for activations than the step used: the reserve the peak supports and what
    auto placement chose with it (``runtime.planning.peak_hint.reserve_probe`` asked it), when that is more
    blocks on the GPU."""
    memory = summary.get("memory") or {}
    probe = memory.get("reserve_probe")
    updated = sum(1 for b in blocks if b.get("gpu_updated"))
    if not probe or probe["updated"] <= probe.get("baseline_updated", updated):
        return
    new = blocks[updated : probe["updated"]]  # forward order: gpu_updated_blocks takes the first ones
    covered = sum(by_block.get(b["index"], 0.0) for b in new)
    saves = min(wait, covered + _spill_saved(summary, steady, new))
    names = new[0]["name"] if len(new) == 1 else f"{new[0]['name']} .. {new[-1]['name']}"
    reserve, budget, peak = cfg["activation_reserve_nbytes"], cfg["gpu_budget_nbytes"], memory["gpu_peak_nbytes"]
    add(f"lower tiers.gpu.activation_reserve from {size_text(reserve)} to {size_text(probe['reserve_nbytes'])}: auto "
        f"placement then updates {len(new)} more block(s) on the GPU ({names}), streams {probe['streamed']} and keeps "
        f"{size_text(probe['keep_for_backward_nbytes'])} for backward",
        saves, wait,
        f"the steps peaked at {size_text(peak)} of the {size_text(budget)} GPU budget: the activations took "
        f"{size_text(probe['beyond_plan_nbytes'])} beyond the plan, and {GPU_MARGIN:.0%} of the budget stays free; "
        f"a block updated on the GPU leaves host memory ({size_text(sum(host_state_itemsize(cfg) * b['numel'] for b in new))}), "
        "so fewer moments spill to NVMe")


def _room(summary: dict[str, Any], cfg: dict[str, Any]) -> int | None:
    """GPU bytes the measured peak left unused, less the margin; None off a GPU or without a peak."""
    peak = (summary.get("memory") or {}).get("gpu_peak_nbytes")
    budget = cfg.get("gpu_budget_nbytes", 0)
    if summary.get("device_type") != "cuda" or not peak or not budget:
        return None
    return max(0, int(budget - peak - GPU_MARGIN * budget))


def _device_nbytes(block: dict[str, Any], itemsize: float) -> float:
    """GPU bytes a block takes when updated there, as the plan counts them: master and moments (``itemsize`` bytes a
    parameter), its weights and its summed gradient in the compute dtype."""
    return itemsize * block["numel"] + 2 * block["weight_nbytes"]


def _fitting(blocks: list[dict[str, Any]], room: float, itemsize: float) -> list[dict[str, Any]]:
    """The first blocks (forward order: what gpu_update_fraction selects) whose device state (master and moments at
    ``itemsize`` bytes a parameter), beyond those already updated there, fits ``room``."""
    taken, used = [], 0.0
    for b in blocks:
        if not b.get("gpu_updated"):
            used += _device_nbytes(b, itemsize)
            if used > room:
                break
        taken.append(b)
    return taken


def _spill_saved(summary: dict[str, Any], steady: dict[str, Any], moved: list[dict[str, Any]]) -> float:
    """The share of the NVMe input wait that moving ``moved`` to the GPU removes: their host state leaves pinned
    memory, and placement.moments: auto keeps that many more bytes of moments there."""
    if (summary.get("config") or {}).get("homes", {}).get("exp_avg") != "host+nvme":
        return 0.0
    offloaded = (summary.get("memory") or {}).get("moments_offloaded_nbytes", 0)
    # Streamed blocks already keep no host gradient and never spill: moving them frees little.
    itemsize = host_state_itemsize(summary.get("config") or {}, weights_copy=False)
    freed = sum(itemsize * b["numel"] for b in moved if not b.get("gpu_updated") and not b.get("gpu_streamed"))
    return steady.get("adam_wait_inputs_s", 0.0) * min(1.0, freed / offloaded) if offloaded else 0.0
