"""The profile as text: traffic per path against the ceilings, a table per step, the blocks that stalled most,
and the advice. Built from the summary alone, so ``tierstore profile DIR`` prints the same report from
summary.json that ``report.txt`` holds."""

from __future__ import annotations

from typing import Any

from runtime.core.text import counted
from runtime.planning.memory_plan import WEIGHT_SOURCE_TEXT
from runtime.profiler.advice import size_text
from runtime.profiler.names import CPU_DEVICE_NOTE, GPU_CAUSE_NAMES, PATHS, cause_names, on_gpu, path_names
from runtime.profiler.shares import OVER_CEILING_NOTE, over_ceiling, share_text

CAUSE_NAMES = GPU_CAUSE_NAMES  # a GPU run's names (runtime.profiler.names.cause_names gives a run's own)
MAX_STEP_ROWS = 40  # longer runs show the first and last steps
MIB = 2**20
PLACING_SHOWN_S = 0.05  # a placement adopted at a commit that took longer is said in the header


def _num(value: float | None, fmt: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def format_report(summary: dict[str, Any]) -> str:
    """The whole report (see the module doc)."""
    parts = [_header(summary), paths_table(summary), _steps_table(summary), _stalls_table(summary),
             _blocks_table(summary), _advice(summary)]
    return "\n\n".join(p for p in parts if p) + "\n"


def _header(summary: dict[str, Any]) -> str:
    cfg: dict[str, Any] = summary.get("config") or {}
    totals = summary["totals"]
    homes = cfg.get("homes") or {}
    source = cfg.get("weight_source")  # a WeightSource value; an older profile's may be missing or unknown
    device_type = summary.get("device_type")
    lines = [f"tierstore profile: {counted(totals['steps'], 'step')} in {summary['duration_s']:.2f} s on {summary.get('device')}; "
             f"NVMe IO {summary.get('nvme_io_mode') or 'none'}",
             f"config: prefetch depth {cfg.get('prefetch_depth')}, budget {size_text(cfg.get('prefetch_budget_nbytes', 0))}; "
             f"nvme io_threads {cfg.get('io_threads')}; master on {homes.get('master')}, moments on {homes.get('exp_avg')}, "
             f"weights from {WEIGHT_SOURCE_TEXT.get(str(source), source)}; "
             f"gpu_update_fraction {cfg.get('gpu_update_fraction')}; "
             f"accumulation {cfg.get('accumulation_steps')}"
             f"{'; activations recomputed' if cfg.get('activations_recomputed') else ''}",
             *(() if on_gpu(device_type) else (CPU_DEVICE_NOTE,))]
    hits, misses = totals["hits"], totals["misses"]
    adam, hidden = totals["adam_s"], totals["adam_hidden_s"]
    work = "GPU" if on_gpu(device_type) else "forward/backward"
    lines.append(f"prefetch: {hits} hits, {misses} misses; CPU Adam {adam:.3f} s, {hidden:.3f} s of it "
                 f"({hidden / adam if adam else 0:.0%}) overlapped {work} work; Adam waited {totals['adam_wait_inputs_s']:.3f} s "
                 "for inputs")
    split = totals.get("adam_split_s") or {}  # absent from summaries saved before it was recorded
    if any(split.values()):
        lines.append(f"CPU Adam's parts: AdamW kernel {split.get('kernel_s', 0.0):.3f} s, widening + clip factors "
                     f"{split.get('scale_s', 0.0):.3f} s, weight refreshes {split.get('refresh_s', 0.0):.3f} s "
                     "(the kernel counts updates run before their commit too; the rest: copying parameters without a "
                     "gradient into early results, write-backs, bookkeeping)")
    for step in summary.get("steps") or []:
        if step.get("placing_s", 0.0) >= PLACING_SHOWN_S:  # absent from summaries saved before it was recorded
            lines.append(f"placement: {step['placing_s']:.1f} s after step {step['step']}'s commit placing the run from "
                         "its measured peak (state moved to the GPU and spilled moments read back, where adopted): in "
                         "no step's time; its transfers count in that step's")
    for role, why in (summary.get("skipped") or {}).items():
        lines.append(f"not written: {role}: {why}")
    if summary.get("dropped_events"):
        lines.append(f"note: {summary['dropped_events']} events beyond the recording cap were counted but not kept "
                     "(busy times and the trace are partial)")
    return "\n".join(lines)


def paths_table(summary: dict[str, Any]) -> str:
    """Traffic per path against its ceiling; a share above the ceiling is flagged, never printed as such."""
    lines = ["traffic per path (all steps; GB/s while busy)",
             f"{'path':<16}{'MiB':>11}{'transfers':>11}{'busy s':>9}{'GB/s':>8}{'ceiling':>9}{'of ceil':>9}"]
    flagged = False
    names = path_names(summary.get("device_type"))
    for kind, figures in summary["totals"]["paths"].items():
        name = names.get(kind, kind)
        flagged = flagged or over_ceiling(figures["of_ceiling"])
        lines.append(f"{name:<16}{figures['nbytes'] / MIB:>11.1f}{figures['count']:>11d}{figures['busy_s']:>9.3f}"
                     f"{_num(figures['gbps']):>8}{_num(figures['ceiling_gbps']):>9}{share_text(figures['of_ceiling']):>9}")
    if flagged:
        lines.append(OVER_CEILING_NOTE)
    return "\n".join(lines)


def _rows(steps: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """The steps to show; None marks the elided middle of a long run."""
    if len(steps) <= MAX_STEP_ROWS:
        return list(steps)
    half = MAX_STEP_ROWS // 2
    return [*steps[:half], None, *steps[-half:]]


def _steps_table(summary: dict[str, Any]) -> str:
    steps = summary["steps"]
    if not steps:
        return "per step: no optimizer step was committed while profiling"
    head = f"{'step':>5}{'step s':>8}{'fwd+bwd':>8}" + "".join(f"{k + ' MiB@GB/s':>17}" for k in PATHS)
    head += f"{'hit/miss':>10}{'Adam s':>8}{'hidden':>8}{'pinned MiB':>11}{'NVMe MiB':>10}"
    lines = ["per step (MiB moved @ GB/s while busy)", head]
    for step in _rows(steps):
        if step is None:
            lines.append(f"{'...':>5}")
            continue
        cells = ""
        for kind in PATHS:
            p = step["paths"].get(kind, {"nbytes": 0, "gbps": None})
            cells += f"{p['nbytes'] / MIB:>10.1f}@{_num(p['gbps'], '<6.2f', '-     ')}"
        usage = step["usage_nbytes"]
        hidden = step["adam_hidden_s"] / step["adam_s"] if step["adam_s"] else None
        lines.append(f"{step['step']:>5}{step['step_s']:>8.3f}{step['compute_s']:>8.3f}{cells}"
                     f"{str(step['hits']) + '/' + str(step['misses']):>10}{step['adam_s']:>8.3f}{_num(hidden, '.0%'):>8}"
                     f"{usage.get('host', 0) / MIB:>11.1f}{usage.get('nvme', 0) / MIB:>10.1f}")
    return "\n".join(lines)


def _stalls_table(summary: dict[str, Any]) -> str:
    steps = summary["steps"]
    if not steps:
        return ""
    device = any(v for s in steps for v in s["device_wait_s"].values())
    causes = cause_names(summary.get("device_type"))
    head = f"{'step':>5}" + "".join(f"{causes[c]:>15}" for c in causes) + f"{'total':>9}  blocks that waited most"
    lines = ["training-thread stalls per step (host seconds by cause"
             + (" + estimated device waits of on-demand copies" if device else "") + ")",
             head]
    names = {b["index"]: b["name"] for b in summary.get("blocks") or []}
    for step in _rows(steps):
        if step is None:
            lines.append(f"{'...':>5}")
            continue
        waits = {c: step["stall_s"].get(c, 0.0) + step["device_wait_s"].get(c, 0.0) for c in causes}
        top = ", ".join(f"{names.get(b, b)} ({causes.get(c, c)} {s:.3f})" for b, c, s in step["top_blocks"])
        lines.append(f"{step['step']:>5}" + "".join(f"{waits[c]:>15.3f}" for c in causes) + f"{sum(waits.values()):>9.3f}  {top}")
    steady = summary.get("steady") or {}
    if steady.get("steps"):
        waits = {c: steady["stall_s"].get(c, 0.0) + steady["device_wait_s"].get(c, 0.0) for c in causes}
        lines.append(f"{'mean':>5}" + "".join(f"{waits[c]:>15.3f}" for c in causes) + f"{sum(waits.values()):>9.3f}"
                     f"  (steps {steady['first_step']}.., of {steady['step_s']:.3f} s/step)")
    return "\n".join(lines)


def _blocks_table(summary: dict[str, Any]) -> str:
    top = summary.get("top_blocks") or []
    if not top:
        return "blocks that stalled: none"
    lines = ["blocks that stalled most (seconds over the whole profile)"]
    names = cause_names(summary.get("device_type"))
    for entry in top:
        causes = ", ".join(f"{names.get(c, c)} {s:.3f}" for c, s in sorted(entry["by_cause"].items(), key=lambda i: -i[1]))
        lines.append(f"  {entry['name']:<28}{entry['seconds']:>9.3f}  {causes}")
    return "\n".join(lines)


def _advice(summary: dict[str, Any]) -> str:
    advice = summary.get("advice") or []
    if not advice:
        return "advice: none (no steady-state step was profiled)"
    return "\n".join(["advice"] + [f"  {i}. {item['text']}" for i, item in enumerate(advice, 1)])
