"""Writing a profile: summary.json, report.txt, trace.json (Chrome Trace Event format) and plot.png.

The trace has one track (thread) per stream kind -- H2D, D2H, NVMe read, NVMe write, the Adam worker,
training-thread stalls -- plus the training steps' forward+backward windows, as "X" (complete) events with
microsecond timestamps relative to the profiler's start. Transfers of one kind that overlap in time (IO
threads run several at once) go to numbered lanes of that kind, because trace viewers draw only nested slices
on one thread.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.core.events import StallEvent
from runtime.profiler.analysis import placed_intervals, summarize
from runtime.profiler.names import cause_names, path_names
from runtime.profiler.records import RawProfile
from runtime.profiler.report import format_report
from tierstore import create_new

log = logging.getLogger(__name__)

PID = 1
# kind -> (tid, track name) of a GPU run (``tracks`` names a run's own); the order is the display order.
TRACKS: dict[str, tuple[int, str]] = {
    "h2d": (1, "h2d: pinned -> GPU"),
    "d2h": (2, "d2h: GPU -> pinned"),
    "read": (3, "NVMe read"),
    "write": (4, "NVMe write"),
    "adam": (5, "Adam worker"),
    "stall": (6, "training-thread stalls"),
    "step": (7, "training steps (forward + backward)"),
}
OTHER_TID = 8
LANE_TID = 100  # lane n > 0 of track t is tid t * LANE_TID + n
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOT_NAME = "plot.png"
PLOT_INSTALL = "install the plot extra: pip install -e '.[plot]'"
NO_MATPLOTLIB = f"matplotlib is not installed ({PLOT_INSTALL})"
PLOT_DISABLED = "disabled (profile.plot: false)"


@dataclass
class SavedProfile:
    """Where a profile was written: file role -> path, and what was skipped (role -> why)."""

    directory: Path
    files: dict[str, Path] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _assign_lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """Greedy lane per interval (in the given order, sorted by start) so that no lane overlaps itself."""
    lane_ends: list[float] = []
    lanes: list[int] = []
    for start, end in intervals:
        for lane, lane_end in enumerate(lane_ends):
            if lane_end <= start:
                lane_ends[lane] = end
                lanes.append(lane)
                break
        else:
            lane_ends.append(end)
            lanes.append(len(lane_ends) - 1)
    return lanes


def tracks(device_type: str | None) -> dict[str, tuple[int, str]]:
    """``TRACKS`` with the device's copy tracks named as the run's device is (``runtime.profiler.names``)."""
    paths = path_names(device_type)
    return {**TRACKS, "h2d": (TRACKS["h2d"][0], f"h2d: {paths['h2d']}"), "d2h": (TRACKS["d2h"][0], f"d2h: {paths['d2h']}")}


def chrome_trace(raw: RawProfile) -> dict[str, Any]:
    """The profile as a Chrome Trace Event document (``{"traceEvents": [...]}``)."""
    t0 = raw.t0_s
    names = {b["index"]: b["name"] for b in raw.meta.get("blocks", [])}
    device_type = raw.meta.get("device_type")
    track_names = tracks(device_type)
    # (track kind, start_s, end_s, name, args)
    slices: list[tuple[str, float, float, str, dict[str, Any]]] = []
    for event, (start, end) in zip(raw.transfers, placed_intervals(raw.transfers), strict=True):
        kind = event.kind if event.kind in track_names else "other"
        rate = event.nbytes / (end - start) / 1e9 if end > start else None
        slices.append((kind, start, end, f"{event.kind} {event.key}",
                       {"key": event.key, "nbytes": event.nbytes, "gbps": rate, "thread": event.thread,
                        "device_s": event.device_s}))
    for block, step, start, end in raw.adam:
        slices.append(("adam", start, end, f"Adam {names.get(block, block)} -> step {step}", {"block": block, "step": step}))
    for stall in raw.stalls:
        slices.append(("stall", stall.start_s, stall.start_s + stall.seconds, _stall_name(stall, names, device_type),
                       {"block": stall.block, "cause": stall.cause, "step": stall.step + 1}))
    for mark in raw.marks:
        slices.append(("step", mark.begin_s, mark.backward_end_s, f"step {mark.step}", {"step": mark.step}))
    by_track: dict[str, list[tuple[float, float, str, dict[str, Any]]]] = {}
    for kind, start, end, name, args in slices:
        by_track.setdefault(kind, []).append((start, end, name, args))
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": "tierstore"}}]
    for kind, items in by_track.items():
        base_tid, track_name = track_names.get(kind, (OTHER_TID, "other transfers"))
        items.sort(key=lambda item: item[0])
        lanes = _assign_lanes([(s, e) for s, e, _, _ in items])
        for lane in range(max(lanes, default=0) + 1):
            tid = base_tid if lane == 0 else base_tid * LANE_TID + lane
            label = track_name if lane == 0 else f"{track_name} #{lane + 1}"
            events.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": label}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid, "args": {"sort_index": tid}})
        for (start, end, name, args), lane in zip(items, lanes, strict=True):
            tid = base_tid if lane == 0 else base_tid * LANE_TID + lane
            events.append({"name": name, "cat": kind, "ph": "X", "pid": PID, "tid": tid, "ts": _us(max(0.0, start - t0)),
                           "dur": _us(max(0.0, end - start)), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "tierstore profiler", "device": raw.meta.get("device")}}


def _stall_name(stall: StallEvent, names: dict[int, str], device_type: str | None) -> str:
    return f"{cause_names(device_type).get(stall.cause, stall.cause)}: {names.get(stall.block, stall.block)}"


def write_plot(summary: dict[str, Any], path: Path) -> bool:
    """Bandwidth per path and stall seconds per step, as a PNG; False (logged) when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        log.warning("plot skipped: %s", NO_MATPLOTLIB)
        return False
    steps = summary["steps"]
    x = [s["step"] for s in steps]
    # The object-oriented API with the Agg canvas: no pyplot, no global backend switch in the caller's process.
    figure = Figure(figsize=(10, 7), tight_layout=True)
    FigureCanvasAgg(figure)
    bandwidth, stalls = figure.subplots(2, 1, sharex=True)
    for kind, name in path_names(summary.get("device_type")).items():
        values = [s["paths"].get(kind, {}).get("gbps") for s in steps]
        if any(v is not None for v in values):
            line = bandwidth.plot(x, [v if v is not None else float("nan") for v in values], marker="o", label=name)[0]
            ceiling = (summary.get("ceilings_gbps") or {}).get(kind)
            if ceiling:
                bandwidth.axhline(ceiling, linestyle="--", color=line.get_color(), alpha=0.6)
    bandwidth.set_ylabel("GB/s while busy (dashed: ceiling)")
    bandwidth.set_title("bandwidth per path")
    if bandwidth.lines:
        bandwidth.legend(loc="best", fontsize="small")
    bottom = [0.0] * len(steps)
    for cause, name in cause_names(summary.get("device_type")).items():
        values = [s["stall_s"].get(cause, 0.0) + s["device_wait_s"].get(cause, 0.0) for s in steps]
        stalls.bar(x, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    stalls.plot(x, [s["step_s"] for s in steps], color="black", marker=".", label="step time")
    stalls.xaxis.set_major_locator(MaxNLocator(integer=True))
    stalls.set_xlabel("optimizer step")
    stalls.set_ylabel("seconds")
    stalls.set_title("training-thread stalls per step, by cause")
    stalls.legend(loc="best", fontsize="small")
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=100)
    write_new(path, png.getvalue())
    return True


def write_new(path: Path, data: bytes) -> None:
    """Write ``data`` as ``path``, created new with ``O_EXCL|O_NOFOLLOW`` (``tierstore.files.create_new``, mode
    0600): a file or a link already at that name (an earlier profile's, or one planted there) is unlinked first,
    never written through."""
    with os.fdopen(create_new(path, flags=os.O_WRONLY, replace_stale=True), "wb") as out:
        out.write(data)


def plot_state(summary: dict[str, Any], directory: Path) -> tuple[Path | None, str | None]:
    """What a saved profile's directory holds of its plot now, for ``tierstore profile DIR``: (the plot's path, None)
    when plot.png is there, whatever the summary says was skipped when it was saved (``--plot`` draws it later);
    else (None, why not): that matplotlib is missing where it is (what a save without it says, and what a run of
    ``profile.plot: auto`` without it may have saved as "disabled"), or the saved reason and how to draw it."""
    path = directory / PLOT_NAME
    if path.is_file():
        return path, None
    if importlib.util.find_spec("matplotlib") is None:
        return None, NO_MATPLOTLIB
    saved = (summary.get("skipped") or {}).get("plot") or "not drawn"
    return None, f"{saved}; tierstore profile {directory} --plot draws it"


def check_profile_dir(directory: str | Path) -> Path:
    """The profile directory, made if missing, refused (ValueError, naming it and what to change) when it is not a
    directory we can write: checked before a run trains, so a run does not end in an error after all its steps."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"profile directory {directory} is a file: give --profile (profile.dir) a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"profile directory {directory} cannot be made ({exc.strerror}): give --profile "
                         "(profile.dir) a directory you can write") from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"profile directory {directory} is not writable: give --profile (profile.dir) a directory "
                         "you can write")
    return directory


def save_profile(raw: RawProfile, directory: str | Path, trace: bool = True, plot: bool = True) -> SavedProfile:
    """Write a raw profile's outputs under directory (created if needed), each file created new: a link planted at
    one of their names is removed, never followed (``write_new``). ``plot``: draw plot.png where matplotlib can be
    imported (``profile.plot: auto`` and ``true``; a skip says that matplotlib is missing), False: not at all
    (``profile.plot: false``)."""
    directory = check_profile_dir(directory)
    saved = SavedProfile(directory)
    summary = summarize(raw)
    if trace:
        saved.files["trace"] = directory / "trace.json"
        write_new(saved.files["trace"], json.dumps(chrome_trace(raw)).encode())
    else:
        saved.skipped["trace"] = "disabled (profile.trace: false)"
    if plot:
        path = directory / PLOT_NAME
        if write_plot(summary, path):
            saved.files["plot"] = path
        else:
            saved.skipped["plot"] = NO_MATPLOTLIB
    else:
        saved.skipped["plot"] = PLOT_DISABLED
    saved.files["report"] = directory / "report.txt"
    saved.files["summary"] = directory / "summary.json"
    summary["outputs"] = {role: path.name for role, path in saved.files.items()}
    summary["skipped"] = dict(saved.skipped)
    write_new(saved.files["report"], format_report(summary).encode())
    write_new(saved.files["summary"], json.dumps(summary, indent=1).encode())
    log.info("profile written to %s (%s)", directory, ", ".join(p.name for p in saved.files.values()))
    return saved
