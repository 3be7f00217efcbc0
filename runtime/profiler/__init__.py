"""Swap-traffic profiler: what moved where, how fast, and why the GPU waited.

- :class:`Profiler` listens to an offload session (the store's transfer events, the controller's stall and step
  events, the optimizer worker's intervals) and writes a profile directory with :meth:`Profiler.save`:
  ``summary.json`` (machine-readable), ``report.txt`` (tables and advice), ``trace.json`` (Chrome Trace Event
  format, for chrome://tracing or Perfetto) and ``plot.png`` (with the optional ``plot`` extra: matplotlib).
- :func:`measure_ceilings` / :func:`ceilings_from_store_bench` give the bandwidth each path can reach.
- :func:`main` is ``tierstore profile DIR``: the report and advice of a saved profile.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from runtime.profiler.advice import advise
from runtime.profiler.ceilings import ceilings_from_store_bench, measure_ceilings
from runtime.profiler.collect import Profiler
from runtime.profiler.outputs import PLOT_INSTALL, PLOT_NAME, SavedProfile, chrome_trace, plot_state, save_profile, write_plot
from runtime.profiler.records import RawProfile, StepMark
from runtime.profiler.report import format_report

__all__ = ["Profiler", "RawProfile", "SavedProfile", "StepMark", "ceilings_from_store_bench", "chrome_trace",
           "format_report", "load_summary", "main", "measure_ceilings", "save_profile"]


def load_summary(directory: str | Path) -> dict[str, Any]:
    """The summary.json of a saved profile."""
    path = Path(directory) / "summary.json"
    if not path.is_file():
        ranks = sorted(p.name for p in Path(directory).glob("rank*") if (p / "summary.json").is_file())
        if ranks:  # tierstore train --nproc N --profile DIR: one profile a rank
            raise FileNotFoundError(f"{directory} holds one profile a process ({', '.join(ranks)}: a run of several "
                                    f"processes, each its own blocks' traffic): read one, e.g. tierstore profile "
                                    f"{Path(directory) / ranks[0]}")
        raise FileNotFoundError(f"{path} not found: write a profile first, e.g. tierstore train --profile {directory}")
    try:
        summary = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a profile's summary (not JSON: {exc}); write the profile again") from None
    missing = [key for key in ("totals", "steps", "duration_s") if not isinstance(summary, dict) or key not in summary]
    if missing:
        raise ValueError(f"{path} is not a profile's summary (no {', '.join(missing)}: written by something else, or "
                         "by another version); write the profile again")
    return summary


def main(args: argparse.Namespace) -> int:
    """``tierstore profile DIR``: print the report (tables and advice) of the profile saved in DIR, with ``--plot``
    draw DIR/plot.png first. The report's line on the plot says what DIR holds now (``plot_state``), not what was
    skipped when the profile was saved; 2 when ``--plot`` could not draw (matplotlib missing)."""
    directory = Path(args.dir)
    summary = load_summary(directory)
    # The advice is a function of the summary alone: given again, a profile saved by an older version reads as
    # this one's advice would (its device named as it is, the micro-batch said where it limits the run).
    if "steady" in summary:  # what the advice is computed from
        summary["advice"] = advise(summary)
    drawn = bool(getattr(args, "plot", False)) and write_plot(summary, directory / PLOT_NAME)
    plot, why = plot_state(summary, directory)  # a plot there already: no line says it was not written
    skipped = {role: reason for role, reason in (summary.get("skipped") or {}).items() if role != "plot"}
    summary["skipped"] = skipped if why is None else {**skipped, "plot": why}
    print(format_report(summary), end="")
    if getattr(args, "plot", False) and not drawn:
        print(f"tierstore profile: --plot needs matplotlib, which is not installed ({PLOT_INSTALL})", file=sys.stderr)
        return 2
    if drawn:
        print(f"plot written to {plot}")
    return 0
