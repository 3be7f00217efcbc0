"""Issue 41's honest output on a CPU-only machine: the report, the trace, the swap summary and the advice call the
device what it is (a GPU run's text unchanged); ``tierstore profile DIR`` says what DIR holds of its plot; the
advice says when the micro-batch limits a run and what lets it grow."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from runtime.core.events import STALL_CAPACITY, STALL_FETCH_HOST, STALL_GRAD_SUM, STALL_UPDATE, StallEvent
from runtime.profiler import main as profile_main
from runtime.profiler import outputs
from runtime.profiler.advice import advise
from runtime.profiler.analysis import summarize
from runtime.profiler.outputs import PNG_SIGNATURE, chrome_trace, save_profile
from runtime.profiler.records import Counters, RawProfile, StepMark
from runtime.profiler.report import format_report
from runtime.profiler.traffic import TrafficCounter
from tierstore import TransferEvent

GB = 10**9
MIB = 2**20


def raw_profile(device_type: str) -> RawProfile:
    """Two steps of 1 s with traffic on every path and a stall of every cause in each (the second is the steady
    one), on a device of ``device_type``."""
    transfers: list[TransferEvent] = []
    stalls: list[StallEvent] = []
    counters = Counters()
    marks: list[StepMark] = []
    for step in (0, 1):
        t = float(step)
        for kind, src, dst in (("h2d", "host", "gpu"), ("d2h", "gpu", "host"), ("read", "nvme", "host"),
                               ("write", "host", "nvme")):
            event = TransferEvent(kind, "block1.master", src, dst, 64 * MIB, t + 0.1, t + 0.2, None)
            transfers.append(event)
            counters.add(kind, event.nbytes, event.duration_s)
        for cause in (STALL_FETCH_HOST, STALL_CAPACITY, STALL_UPDATE, STALL_GRAD_SUM):
            stalls.append(StallEvent(1, cause, 0.05, step, t + 0.3))
        marks.append(StepMark(step + 1, t, t + 0.8, t + 1.0, len(transfers), len(stalls), counters.copy(), 2, 0, 0.0,
                              {"gpu": 1, "host": 2, "nvme": 3}))
    meta = {"device": "CPU (no CUDA)" if device_type == "cpu" else "H200", "device_type": device_type,
            "nvme_io_mode": "direct",
            "config": {"prefetch_depth": 2, "prefetch_budget_nbytes": 1 << 30, "io_threads": 4, "gpu_update_fraction": 0.0,
                       "accumulation_steps": 4, "cpu_threads": 2, "weight_source": "master", "host_grad_itemsize": 4,
                       "homes": {"master": "host", "exp_avg": "host", "exp_avg_sq": "host", "grad": "host",
                                 "weights": "host"},
                       "gpu_budget_nbytes": 8 << 30, "host_budget_nbytes": 8 << 30},
            "blocks": [{"index": i, "name": f"layers.{i}", "numel": 1 << 20, "weight_nbytes": 4 << 20,
                        "source_key": f"block{i}.master", "gpu_updated": False} for i in range(3)],
            "memory": {"host_available_nbytes": 64 << 30, "moments_offloaded_nbytes": 0}}
    return RawProfile(0.0, 2.5, transfers, stalls, [(1, 1, 0.2, 0.6), (1, 2, 1.2, 1.6)], marks, counters, 4, 0, 0.0, 0,
                      meta, {"h2d": 50.0, "d2h": 50.0, "read": 5.0, "write": 5.0})


def test_a_cpu_run_s_report_names_no_gpu_and_no_pinned_memory() -> None:
    summary = summarize(raw_profile("cpu"))
    report = format_report(summary)
    assert "GPU" not in report, report
    assert "pinned -> device" in report and "device -> pinned" in report and "device full" in report
    assert "the device is the CPU" in report
    assert any("device memory" in item["text"] for item in summary["advice"])  # gpu_update_fraction's item


def test_a_gpu_run_s_report_keeps_its_words() -> None:
    report = format_report(summarize(raw_profile("cuda")))
    assert "pinned -> GPU" in report and "GPU -> pinned" in report and "GPU full" in report
    assert "the device is the CPU" not in report
    assert "more GPU memory" in report


def test_a_summary_without_a_device_type_reads_as_a_gpu_run_s() -> None:
    summary = summarize(raw_profile("cuda"))
    del summary["device_type"]  # saved before it was recorded
    assert "pinned -> GPU" in format_report(summary)


def test_a_cpu_run_s_trace_and_swap_summary_name_no_gpu() -> None:
    trace = chrome_trace(raw_profile("cpu"))
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "h2d: pinned -> device" in tracks and not any("GPU" in name for name in tracks)
    counter = TrafficCounter("cpu")
    counter(TransferEvent("h2d", "k", "host", "gpu", MIB, 0.0, 0.001, None))
    assert "GPU" not in counter.summary() and "pinned -> device" in counter.summary()
    assert "pinned -> GPU" in TrafficCounter().summary()  # a GPU run's (the default) as before


# ---- tierstore profile DIR: the plot line says what DIR holds ----------------------------------------------------
def _saved(tmp_path: Path, plot: bool) -> Path:
    directory = tmp_path / "prof"
    save_profile(raw_profile("cpu"), directory, plot=plot)
    return directory


def _profile(directory: Path, plot: bool, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = profile_main(argparse.Namespace(dir=str(directory), plot=plot))
    out, err = capsys.readouterr()
    return rc, out, err


def _fake_plot(summary: dict[str, Any], path: Path) -> bool:
    outputs.write_new(path, PNG_SIGNATURE + b"fake")
    return True


def test_profile_says_plot_written_when_it_drew_one(tmp_path, monkeypatch, capsys):
    """The issue: "plot: disabled (profile.plot: false)" printed beside the plot.png it had just written."""
    directory = _saved(tmp_path, plot=False)
    monkeypatch.setattr("runtime.profiler.write_plot", _fake_plot)
    rc, out, _ = _profile(directory, True, capsys)
    assert rc == 0 and f"plot written to {directory / 'plot.png'}" in out
    assert "not written: plot" not in out and "disabled" not in out


def test_profile_names_a_plot_drawn_before(tmp_path, monkeypatch, capsys):
    directory = _saved(tmp_path, plot=False)  # summary.json says the plot was skipped...
    outputs.write_new(directory / "plot.png", PNG_SIGNATURE)  # ...and a later --plot drew it
    rc, out, _ = _profile(directory, False, capsys)
    assert rc == 0 and "not written: plot" not in out and "disabled" not in out


def test_profile_says_matplotlib_is_missing_and_how_to_install_it(tmp_path, monkeypatch, capsys):
    directory = _saved(tmp_path, plot=False)  # profile.plot: auto without matplotlib was saved as "disabled"
    monkeypatch.setattr(outputs.importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr("runtime.profiler.write_plot", lambda summary, path: False)
    rc, out, _ = _profile(directory, False, capsys)
    line = next(line for line in out.splitlines() if line.startswith("not written: plot"))
    assert "matplotlib is not installed" in line and "'.[plot]'" in line and "disabled" not in line
    rc, out, err = _profile(directory, True, capsys)
    assert rc == 2 and "needs matplotlib, which is not installed" in err and "'.[plot]'" in err


def test_profile_with_matplotlib_keeps_the_saved_reason_and_says_how_to_draw(tmp_path, monkeypatch, capsys):
    directory = _saved(tmp_path, plot=False)
    monkeypatch.setattr(outputs.importlib.util, "find_spec", lambda name, *a: object())
    rc, out, _ = _profile(directory, False, capsys)
    assert "not written: plot: disabled (profile.plot: false); tierstore profile" in out and "--plot draws it" in out


def test_a_saved_profile_skipping_the_plot_says_matplotlib_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs, "write_plot", lambda summary, path: False)
    directory = _saved(tmp_path, plot=True)
    skipped = json.loads((directory / "summary.json").read_text())["skipped"]
    assert skipped["plot"] == outputs.NO_MATPLOTLIB and "'.[plot]'" in skipped["plot"]


# ---- the micro-batch --------------------------------------------------------------------------------------------
def fetch_bound(**config: Any) -> dict[str, Any]:
    """A steady state of 2 s steps whose weights' copies keep the link busy 1.6 s and the training thread waits
    0.8 s on fetches, with ``config`` over 8 micro-batches a step fetching from the fp32 master."""
    causes = {STALL_FETCH_HOST: 0.8, STALL_CAPACITY: 0.0, STALL_UPDATE: 0.0, STALL_GRAD_SUM: 0.0}
    cfg = {"accumulation_steps": 8, "weight_source": "master", "prefetch_depth": 2, "prefetch_budget_nbytes": 8 << 30,
           "io_threads": 4, "gpu_budget_nbytes": 24 << 30, **config}
    return {"device_type": "cuda", "config": cfg, "memory": {}, "totals": {"paths": {}},
            "blocks": [{"index": 0, "name": "layers.0", "numel": 1 << 20, "weight_nbytes": 2 << 20}],
            "steady": {"steps": 2, "first_step": 2, "step_s": 2.0, "compute_s": 1.5, "hit_rate": 0.9,
                       "paths": {"h2d": {"nbytes": 64 << 30, "busy_s": 1.6, "gbps": 43.0}},
                       "stall_s": causes, "device_wait_s": dict.fromkeys(causes, 0.0), "adam_s": 0.1,
                       "adam_hidden_s": 0.1, "adam_wait_inputs_s": 0.0, "update_stall_by_block": {}}}


def _micro_batch_item(summary: dict[str, Any]) -> dict[str, Any] | None:
    return next((item for item in advise(summary) if "micro-batch limits" in item["change"]), None)


def test_the_advice_says_when_the_micro_batch_limits_the_run_and_what_lets_it_grow():
    item = _micro_batch_item(fetch_bound())
    assert item is not None
    assert "lower optimizer.accumulation_steps from 8 to 4" in item["change"]
    assert "each of the 8 micro-batches fetches the weights again" in item["text"]
    assert "placement.activations: recompute" in item["text"] and "use_liger_kernel=True" in item["text"]
    assert item["saves_s"] == pytest.approx(0.8)  # the fetch waits (half the link's 1.6 s would be as much)
    recomputed = _micro_batch_item(fetch_bound(activations_recomputed=True))
    assert recomputed is not None and "placement.activations" not in recomputed["text"]  # already on


@pytest.mark.parametrize("change", [
    {"accumulation_steps": 1},  # one micro-batch a step: nothing to divide within the step
    {"weight_source": "resident"},  # the weights are never fetched
], ids=["one-micro-batch", "resident-weights"])
def test_no_micro_batch_advice_where_nothing_is_fetched_per_micro_batch(change):
    assert _micro_batch_item(fetch_bound(**change)) is None


def test_no_micro_batch_advice_when_the_fetches_are_not_what_holds_the_step():
    summary = fetch_bound()
    summary["steady"]["paths"]["h2d"]["busy_s"] = 0.5  # a quarter of the step
    assert _micro_batch_item(summary) is None
    summary = fetch_bound()
    summary["steady"]["stall_s"][STALL_FETCH_HOST] = 0.0  # the fetches hide behind the compute
    assert _micro_batch_item(summary) is None


def test_on_a_full_gpu_the_micro_batch_item_says_what_must_make_room_first():
    """The 8B Trainer's case: the peak left less than twice the activations; the item says to make room first."""
    summary = fetch_bound(gpu_plan_nbytes=10 << 30)
    summary["memory"] = {"gpu_peak_nbytes": 22 << 30}  # 12 GiB of activations, 24 GiB budget, 5% margin
    item = _micro_batch_item(summary)
    assert item is not None and "make room first with" in item["text"] and "use_liger_kernel=True" in item["text"]
