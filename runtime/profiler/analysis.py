"""From a raw profile to figures: per-step traffic, bandwidth against the ceilings, stalls by cause and block,
CPU Adam time and how much of it hid behind the GPU work, memory in use; then the advice.

Pure functions over :class:`~runtime.profiler.records.RawProfile`; nothing here touches torch or the session.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from runtime.core.events import STALL_CAPACITY, STALL_FETCH_HOST, STALL_FETCH_NVME, STALL_GRAD_SUM, STALL_UPDATE, StallEvent
from runtime.profiler.advice import advise
from runtime.profiler.names import PATHS
from runtime.profiler.records import Counters, RawProfile, StepMark
from runtime.profiler.shares import ceiling_share, over_ceiling
from tierstore import TransferEvent

SUMMARY_VERSION = 1
CAUSES = (STALL_FETCH_HOST, STALL_FETCH_NVME, STALL_UPDATE, STALL_CAPACITY, STALL_GRAD_SUM)
FETCH_CAUSES = (STALL_FETCH_HOST, STALL_FETCH_NVME, STALL_CAPACITY)
TOP_BLOCKS_PER_STEP = 3
TOP_BLOCKS = 10

Interval = tuple[float, float]


# ---- interval arithmetic ---------------------------------------------------------------------------------
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time as ``intervals`` (empty ones dropped)."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def length(intervals: Iterable[Interval]) -> float:
    """Total length of intervals (assumed disjoint)."""
    return sum(end - start for start, end in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two sorted disjoint interval lists."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Parts of sorted disjoint ``a`` not covered by sorted disjoint ``b``."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def placed_intervals(transfers: list[TransferEvent]) -> list[Interval]:
    """When each transfer's bytes moved, as well as the host can tell (aligned with ``transfers``).

    File IO: host times are exact. A device copy ran for its CUDA-measured duration on its kind's one stream,
    where copies run one after another in issue order; it ended no later than its completion was observed
    (several copies are often observed by one poll) and no later than the next copy on that stream began.
    Walking each stream backwards from the last copy places every copy at its latest possible time; the
    placed copies do not overlap, so their union is the stream's busy time (the sum of the CUDA durations)."""
    out: list[Interval] = [(e.start_s, e.end_s) for e in transfers]
    streams: dict[str, list[int]] = {}
    for i, event in enumerate(transfers):
        if event.device_s is not None:
            streams.setdefault(event.kind, []).append(i)
    for indices in streams.values():
        indices.sort(key=lambda i: transfers[i].start_s)
        next_start = float("inf")
        for i in reversed(indices):
            event = transfers[i]
            end = min(event.end_s, next_start)
            next_start = end - (event.device_s or 0.0)
            out[i] = (next_start, end)
    return out


def gbps(nbytes: int, seconds: float) -> float | None:
    """Bandwidth in GB/s (1e9 bytes), None when nothing was timed."""
    return nbytes / seconds / 1e9 if seconds > 0 else None


# ---- per step --------------------------------------------------------------------------------------------
def _path_figures(counters: Counters, before: Counters | None, events: list[TransferEvent], placed: list[Interval],
                  ceilings: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Bytes, count and summed seconds per kind (counter differences), and the busy (union) seconds and busy
    bandwidth of the recorded events.

    A rate's bytes and its busy time come from the same events: past the recording cap the counters go on
    counting bytes whose intervals were not kept, and dividing those by the kept intervals' time would read
    faster than the path ran (``recorded_nbytes`` < ``nbytes`` then)."""
    kinds = sorted(set(counters.nbytes) | set(PATHS), key=lambda k: (PATHS.index(k) if k in PATHS else len(PATHS), k))
    out: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        prev_n = before.nbytes.get(kind, 0) if before else 0
        prev_c = before.count.get(kind, 0) if before else 0
        prev_s = before.seconds.get(kind, 0.0) if before else 0.0
        mine = [(e, interval) for e, interval in zip(events, placed, strict=True) if e.kind == kind]
        recorded = sum(e.nbytes for e, _ in mine)
        busy_s = length(union(interval for _, interval in mine))
        rate = gbps(recorded, busy_s)
        ceiling = ceilings.get(kind)
        share = ceiling_share(rate, ceiling)
        out[kind] = {"nbytes": counters.nbytes.get(kind, 0) - prev_n, "recorded_nbytes": recorded,
                     "count": counters.count.get(kind, 0) - prev_c, "sum_s": counters.seconds.get(kind, 0.0) - prev_s,
                     "busy_s": busy_s, "gbps": rate, "ceiling_gbps": ceiling, "of_ceiling": share,
                     "over_ceiling": over_ceiling(share)}
    return out


def _stall_figures(stalls: list[StallEvent], device_waits: dict[int, float]) -> dict[str, Any]:
    """Host seconds per cause, estimated device seconds per cause, and the blocks that waited most."""
    by_cause = dict.fromkeys(CAUSES, 0.0)
    device = dict.fromkeys(CAUSES, 0.0)
    by_block: dict[tuple[int, str], float] = {}
    for i, stall in enumerate(stalls):
        by_cause[stall.cause] = by_cause.get(stall.cause, 0.0) + stall.seconds
        device[stall.cause] = device.get(stall.cause, 0.0) + device_waits.get(i, 0.0)
        key = (stall.block, stall.cause)
        by_block[key] = by_block.get(key, 0.0) + stall.seconds + device_waits.get(i, 0.0)
    top = sorted(by_block.items(), key=lambda item: -item[1])[:TOP_BLOCKS_PER_STEP]
    return {"stall_s": by_cause, "device_wait_s": device, "top_blocks": [[b, c, s] for (b, c), s in top]}


def device_waits(stalls: list[StallEvent], transfers: list[TransferEvent], source_keys: dict[int, str]) -> dict[int, float]:
    """Per fetch stall (by position): the CUDA-measured duration of the H2D copies it issued (a fetch from the fp32
    master crosses in pieces, each its own event: [Note: fetch staging] in runtime.engine.weights). On a GPU an
    on-demand copy makes the compute stream wait on the device, which host time does not show."""
    issued: dict[str, list[TransferEvent]] = {}
    for event in transfers:
        if event.kind == "h2d" and event.device_s is not None:
            issued.setdefault(event.key, []).append(event)
    out: dict[int, float] = {}
    for i, stall in enumerate(stalls):
        if stall.cause not in FETCH_CAUSES:
            continue
        pieces = [event.device_s or 0.0 for event in issued.get(source_keys.get(stall.block, ""), [])
                  if stall.start_s <= event.start_s <= stall.start_s + stall.seconds]
        if pieces:
            out[i] = sum(pieces)
    return out


def _adam_figures(adam: list[tuple[int, int, float, float]], gpu_work: list[Interval]) -> dict[int, tuple[float, float]]:
    """Per optimizer step: (Adam seconds, seconds of it that overlapped GPU work)."""
    out: dict[int, tuple[float, float]] = {}
    for _block, step, start, end in adam:
        hidden = length(intersect([(start, end)], gpu_work))
        total, overlapped = out.get(step, (0.0, 0.0))
        out[step] = (total + end - start, overlapped + hidden)
    return out


def summarize(raw: RawProfile) -> dict[str, Any]:
    """The machine-readable summary of a raw profile: what summary.json holds."""
    t0 = raw.t0_s
    source_keys = _source_keys(raw.meta)
    waits = device_waits(raw.stalls, raw.transfers, source_keys)
    placed = placed_intervals(raw.transfers)
    # GPU work: the training thread inside forward / backward and not blocked (a stall is not GPU work).
    windows = union((m.begin_s, m.backward_end_s) for m in raw.marks)
    gpu_work = subtract(windows, union((s.start_s, s.start_s + s.seconds) for s in raw.stalls))
    adam = _adam_figures(raw.adam, gpu_work)
    steps: list[dict[str, Any]] = []
    prev: StepMark | None = None
    for mark in raw.marks:
        t_lo, s_lo = (prev.num_transfers, prev.num_stalls) if prev else (0, 0)
        stalls = raw.stalls[s_lo : mark.num_stalls]
        step_waits = {i - s_lo: w for i, w in waits.items() if s_lo <= i < mark.num_stalls}
        adam_s, hidden_s = adam.get(mark.step, (0.0, 0.0))
        # the time a placement took after the last commit is no step's
        start = prev.commit_s + prev.placing_s if prev else t0
        steps.append({
            "step": mark.step,
            "start_s": start - t0,
            "step_s": mark.commit_s - start,
            "placing_s": mark.placing_s,
            "compute_s": mark.backward_end_s - mark.begin_s,
            "paths": _path_figures(mark.counters, prev.counters if prev else None, raw.transfers[t_lo : mark.num_transfers],
                                   placed[t_lo : mark.num_transfers], raw.ceilings_gbps),
            "hits": mark.hits - (prev.hits if prev else 0),
            "misses": mark.misses - (prev.misses if prev else 0),
            **_stall_figures(stalls, step_waits),
            "adam_s": adam_s,
            "adam_hidden_s": hidden_s,
            "adam_wait_inputs_s": mark.wait_inputs_s - (prev.wait_inputs_s if prev else 0.0),
            "usage_nbytes": dict(mark.usage),
        })
        prev = mark
    totals_stalls = _stall_figures(raw.stalls, waits)
    total_adam = sum(a for a, _ in adam.values())
    summary: dict[str, Any] = {
        "version": SUMMARY_VERSION,
        **{k: raw.meta.get(k) for k in ("device", "device_type", "nvme_io_mode", "config", "blocks", "memory", "placement_steps")},
        "ceilings_gbps": dict(raw.ceilings_gbps),
        "duration_s": raw.end_s - t0,
        "dropped_events": raw.dropped_events,
        "totals": {
            "steps": len(raw.marks),
            "paths": _path_figures(raw.counters, None, raw.transfers, placed, raw.ceilings_gbps),
            "hits": raw.hits,
            "misses": raw.misses,
            "stall_s": totals_stalls["stall_s"],
            "device_wait_s": totals_stalls["device_wait_s"],
            "adam_s": total_adam,
            "adam_hidden_s": sum(h for _, h in adam.values()),
            "adam_wait_inputs_s": raw.wait_inputs_s,
            "adam_split_s": dict(raw.adam_split_s),
        },
        "top_blocks": top_blocks(raw.stalls, waits, raw.meta),
        "steps": steps,
    }
    summary["steady"] = steady_state(steps, _steady_update_stall_by_block(raw),
                                     skip=_unsteady_steps(raw.meta, [step["step"] for step in steps]))
    summary["advice"] = advise(summary)
    return summary


def _unsteady_steps(meta: dict[str, Any], step_numbers: list[int]) -> int:
    """Steps of the profile a steady state leaves out: its first (the session's first learns the schedule), or
    every step auto placement measured before it placed the state (two with a recompute trial:
    runtime.planning.measured_placement), those the profile saw: ``step_numbers`` are its steps' optimizer steps."""
    measured = int(meta.get("placement_steps", 0))
    return max(1, sum(1 for number in step_numbers if number <= measured))


def _steady_update_stall_by_block(raw: RawProfile) -> dict[str, float]:
    """Mean update-stall seconds per steady step (those after ``_unsteady_steps``) by block."""
    skip = _unsteady_steps(raw.meta, [mark.step for mark in raw.marks])
    first = skip if len(raw.marks) > skip else max(0, len(raw.marks) - 1)
    lo = raw.marks[first - 1].num_stalls if first else 0
    hi = raw.marks[-1].num_stalls if raw.marks else 0
    by_block: dict[str, float] = {}
    for stall in raw.stalls[lo:hi]:
        if stall.cause == STALL_UPDATE:
            by_block[str(stall.block)] = by_block.get(str(stall.block), 0.0) + stall.seconds
    num_steady = max(1, len(raw.marks) - first)
    return {block: seconds / num_steady for block, seconds in by_block.items()}


def _source_keys(meta: dict[str, Any]) -> dict[int, str]:
    """Block index -> the store key its weights are fetched from."""
    return {b["index"]: b.get("source_key", "") for b in meta.get("blocks", [])}


def top_blocks(stalls: list[StallEvent], waits: dict[int, float], meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The blocks the training thread waited on most, with the split by cause."""
    names = {b["index"]: b["name"] for b in meta.get("blocks", [])}
    per_block: dict[int, dict[str, float]] = {}
    for i, stall in enumerate(stalls):
        causes = per_block.setdefault(stall.block, {})
        causes[stall.cause] = causes.get(stall.cause, 0.0) + stall.seconds + waits.get(i, 0.0)
    ranked = sorted(per_block.items(), key=lambda item: -sum(item[1].values()))[:TOP_BLOCKS]
    return [{"block": b, "name": names.get(b, f"block{b}"), "seconds": sum(c.values()), "by_cause": c} for b, c in ranked]


def steady_state(steps: list[dict[str, Any]], update_stall_by_block: dict[str, float] | None = None, *,
                 skip: int = 1) -> dict[str, Any]:
    """Per-step means over the steps after the first ``skip`` (the first learns the schedule; with auto placement
    measured, the steps before it placed the state; the last one alone where no more ran).
    ``update_stall_by_block``: mean update-stall seconds per step by block (JSON keys are strings)."""
    chosen = steps[skip:] if len(steps) > skip else steps[-1:]
    if not chosen:
        return {"steps": 0}

    def mean(values: Iterable[float]) -> float:
        return statistics.fmean(values)

    paths: dict[str, dict[str, Any]] = {}
    for kind in chosen[0]["paths"]:
        nbytes = sum(s["paths"][kind]["nbytes"] for s in chosen)
        recorded = sum(s["paths"][kind].get("recorded_nbytes", s["paths"][kind]["nbytes"]) for s in chosen)
        busy = sum(s["paths"][kind]["busy_s"] for s in chosen)
        paths[kind] = {"nbytes": nbytes / len(chosen), "busy_s": busy / len(chosen), "gbps": gbps(recorded, busy)}
    hits, misses = sum(s["hits"] for s in chosen), sum(s["misses"] for s in chosen)
    return {
        "steps": len(chosen),
        "first_step": chosen[0]["step"],
        "step_s": mean(s["step_s"] for s in chosen),
        "compute_s": mean(s["compute_s"] for s in chosen),
        "paths": paths,
        "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
        "stall_s": {c: mean(s["stall_s"].get(c, 0.0) for s in chosen) for c in CAUSES},
        "device_wait_s": {c: mean(s["device_wait_s"].get(c, 0.0) for s in chosen) for c in CAUSES},
        "adam_s": mean(s["adam_s"] for s in chosen),
        "adam_hidden_s": mean(s["adam_hidden_s"] for s in chosen),
        "adam_wait_inputs_s": mean(s["adam_wait_inputs_s"] for s in chosen),
        "update_stall_by_block": dict(update_stall_by_block or {}),
    }
