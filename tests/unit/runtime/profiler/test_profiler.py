"""Tests of runtime.profiler on synthetic events: counters, bandwidths, stalls, Adam overlap, advice, outputs."""

from __future__ import annotations

import json
import logging
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from runtime.core.events import STALL_CAPACITY, STALL_FETCH_HOST, STALL_UPDATE, StallEvent, StepEvent
from runtime.engine.schedule import ScheduleStats
from runtime.engine.stats import StepStats, emit
from runtime.profiler import Profiler, ceilings_from_store_bench, chrome_trace, format_report, measure_ceilings
from runtime.profiler import collect as collect_module
from runtime.profiler.advice import advise
from runtime.profiler.analysis import intersect, length, placed_intervals, subtract, union
from runtime.profiler.outputs import PNG_SIGNATURE, TRACKS, save_profile, tracks
from runtime.profiler.shares import CEILING_NOISE, OVER_CEILING_MARK, OVER_CEILING_NOTE, share_text
from runtime.update.worker import WorkerStats
from tierstore import EventBus, StoreConfig, TierStore, TransferEvent

GB = 10**9
T0 = 1000.0  # synthetic perf_counter origin

META: dict[str, Any] = {
    "device": "test", "device_type": "cpu", "nvme_io_mode": "buffered",
    "config": {"prefetch_depth": 2, "prefetch_budget_nbytes": 1 << 30, "io_threads": 4, "gpu_update_fraction": 0.0,
               "accumulation_steps": 1, "cpu_threads": 4, "weight_source": "master",
               "homes": {"master": "host", "exp_avg": "nvme", "exp_avg_sq": "nvme", "grad": "host", "weights": "host"},
               "gpu_budget_nbytes": 8 << 30, "host_budget_nbytes": 8 << 30},
    "blocks": [{"index": i, "name": f"layers.{i}", "numel": 1000, "weight_nbytes": 4000, "source_key": f"block{i}.master",
                "gpu_updated": False} for i in range(4)],
    "memory": {"host_available_nbytes": 64 << 30, "moments_offloaded_nbytes": 32000},
}


class FakeSession:
    """Just what the profiler reads of a session: bus, usage, controller hooks and stats, placement."""

    def __init__(self) -> None:
        self.store = SimpleNamespace(bus=EventBus(), device=torch.device("cpu"),
                                     usage=lambda: {"gpu": {"used_nbytes": 1, "capacity_nbytes": 9},
                                                    "host": {"used_nbytes": 2, "capacity_nbytes": 9},
                                                    "nvme": {"used_nbytes": 3, "capacity_nbytes": 9}})
        self.controller = SimpleNamespace(
            stall_listeners=[], step_listeners=[], stats=StepStats(), schedule=SimpleNamespace(stats=ScheduleStats()),
            worker=SimpleNamespace(stats=WorkerStats(), record_intervals=False))
        self.placement = None  # what offload() resolved (the profiler re-reads the session when it changes)

    def transfer(self, kind: str, nbytes: int, start: float, end: float, device_s: float | None = None, key: str = "k") -> None:
        self.store.bus.publish(TransferEvent(kind, key, "a", "b", nbytes, T0 + start, T0 + end, device_s))

    def stall(self, block: int, cause: str, start: float, seconds: float, step: int) -> None:
        for listener in self.controller.stall_listeners:
            listener(StallEvent(block, cause, seconds, step, T0 + start))

    def begin(self, at: float, step: int, signature: str = "train") -> None:
        for listener in self.controller.step_listeners:
            listener(StepEvent("begin", step, T0 + at, signature))

    def commit(self, backward_end: float, at: float, step: int, hits: int = 0, misses: int = 0) -> None:
        self.controller.stats.backward_end_s.append(T0 + backward_end)
        self.controller.schedule.stats.hits += hits
        self.controller.schedule.stats.misses += misses
        for listener in self.controller.step_listeners:
            listener(StepEvent("commit", step, T0 + at))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeSession, Profiler]:
    monkeypatch.setattr(collect_module, "session_meta", lambda session: json.loads(json.dumps(META)))
    session = FakeSession()
    profiler = Profiler(session, ceilings={"h2d": 4.0, "read": 2.0}).start()  # type: ignore[arg-type]
    profiler._t0_s = profiler._last_commit_s = T0  # synthetic clock
    return session, profiler


def two_steps(session: FakeSession) -> None:
    """Step 1: [0, 10] s; step 2: [10, 20] s; then a tail write after the last commit."""
    session.begin(0.5, 0)
    session.transfer("h2d", 2 * GB, 1.0, 3.0, device_s=0.5)  # device time: 1 GB/s... active [2.5, 3.0]
    session.transfer("read", 1 * GB, 2.0, 3.0)
    session.transfer("read", 1 * GB, 2.5, 3.5)  # overlaps: busy 1.5 s for 2 GB
    session.transfer("d2h", 3 * GB, 4.0, 7.0)
    session.stall(0, STALL_FETCH_HOST, 1.0, 0.25, 0)
    session.stall(1, STALL_FETCH_HOST, 2.0, 0.5, 0)
    session.controller.worker.stats.intervals.append((1, 1, T0 + 6.0, T0 + 9.0))  # Adam for step 1: 3 s
    session.commit(backward_end=8.0, at=10.0, step=1, hits=1, misses=2)
    session.begin(10.5, 1, signature="eval")  # not a training forward: not the window start
    session.begin(11.0, 1)
    session.stall(0, STALL_UPDATE, 11.0, 1.0, 1)  # waits for block 0's update inside the window
    session.controller.worker.stats.intervals.append((0, 1, T0 + 10.0, T0 + 12.0))  # 2 s more Adam for step 1
    session.transfer("write", 4 * GB, 12.0, 14.0)
    session.transfer("h2d", 1 * GB, 13.0, 14.0)
    session.stall(2, STALL_CAPACITY, 15.0, 0.75, 1)
    session.commit(backward_end=18.0, at=20.0, step=2, hits=3, misses=0)
    session.transfer("write", 5 * GB, 21.0, 22.0)  # after the last commit: only in the totals


def test_interval_arithmetic():
    assert union([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert intersect([(0, 2), (3, 4)], [(1, 3.5)]) == [(1, 2), (3, 3.5)]
    assert subtract([(0, 10)], [(1, 2), (5, 6), (9, 12)]) == [(0, 1), (2, 5), (6, 9)]
    assert subtract([(0, 1)], []) == [(0, 1)]


def test_counters_add_up_exactly(fake):
    session, profiler = fake
    two_steps(session)
    profiler.stop()
    summary = profiler.summary()
    steps = summary["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[0]["paths"]["h2d"]["nbytes"] == 2 * GB and steps[1]["paths"]["h2d"]["nbytes"] == 1 * GB
    assert steps[0]["paths"]["read"]["nbytes"] == 2 * GB and steps[0]["paths"]["read"]["count"] == 2
    assert steps[0]["paths"]["write"]["nbytes"] == 0 and steps[1]["paths"]["write"]["nbytes"] == 4 * GB
    totals = summary["totals"]["paths"]
    assert {k: totals[k]["nbytes"] for k in ("h2d", "d2h", "read", "write")} == {"h2d": 3 * GB, "d2h": 3 * GB, "read": 2 * GB,
                                                                                "write": 9 * GB}
    for kind in ("h2d", "d2h", "read"):  # no tail traffic on these paths: the steps hold everything
        assert sum(s["paths"][kind]["nbytes"] for s in steps) == totals[kind]["nbytes"]
        assert sum(s["paths"][kind]["count"] for s in steps) == totals[kind]["count"]
    assert totals["write"]["count"] == 2
    assert [(s["hits"], s["misses"]) for s in steps] == [(1, 2), (3, 0)]
    assert steps[0]["usage_nbytes"] == {"gpu": 1, "host": 2, "nvme": 3}
    assert steps[0]["step_s"] == pytest.approx(10.0) and steps[1]["step_s"] == pytest.approx(10.0)
    assert steps[0]["compute_s"] == pytest.approx(7.5)  # first training forward 0.5 .. backward end 8.0
    assert steps[1]["compute_s"] == pytest.approx(7.0)  # the eval forward at 10.5 does not open the window


def test_bandwidth_uses_busy_time_and_device_time(fake):
    session, profiler = fake
    two_steps(session)
    step = profiler.summary()["steps"][0]["paths"]
    assert step["h2d"]["busy_s"] == pytest.approx(0.5)  # the CUDA-measured duration, not the 2 s of host time
    assert step["h2d"]["gbps"] == pytest.approx(4.0)
    assert step["h2d"]["of_ceiling"] == pytest.approx(1.0)
    assert step["read"]["busy_s"] == pytest.approx(1.5)  # the union of two overlapping reads
    assert step["read"]["gbps"] == pytest.approx(2 / 1.5)
    assert step["read"]["sum_s"] == pytest.approx(2.0)
    assert step["read"]["of_ceiling"] == pytest.approx(2 / 1.5 / 2.0)
    assert step["d2h"]["gbps"] == pytest.approx(1.0) and step["d2h"]["of_ceiling"] is None  # no ceiling given
    assert step["write"]["gbps"] is None


def test_device_copies_observed_together_are_serialized_on_their_stream():
    # Three H2D copies whose completion one poll observed at t=10: they ran one after another on the stream.
    events = [TransferEvent("h2d", f"k{i}", "host", "gpu", GB, T0 + i, T0 + 10.0, device_s=d)
              for i, d in enumerate((2.0, 3.0, 1.0))]
    events.append(TransferEvent("read", "r", "nvme", "host", GB, T0 + 1.0, T0 + 4.0))  # file IO: host times
    placed = placed_intervals(events)
    assert placed[2] == (T0 + 9.0, T0 + 10.0)
    assert placed[1] == (T0 + 6.0, T0 + 9.0)
    assert placed[0] == (T0 + 4.0, T0 + 6.0)
    assert placed[3] == (T0 + 1.0, T0 + 4.0)
    assert length(union(placed[:3])) == pytest.approx(6.0)  # the sum of the CUDA durations, not the longest


def test_overlapping_copies_never_read_above_their_ceiling(fake):
    """Two 1 GB GPU -> pinned copies at the link's 50 GB/s, issued together and observed complete by one poll:
    their host windows coincide, so bytes over the union of host windows would read 100 GB/s (200%). On the
    copy stream they ran one after the other: 2 GB in 0.04 s, 100%. Two file reads on two IO threads that
    overlap are one aggregate rate, against the disk's aggregate ceiling."""
    session, profiler = fake
    profiler.ceilings_gbps = {"d2h": 50.0, "read": 2.0}
    session.begin(0.0, 0)
    session.transfer("d2h", GB, 1.0, 1.02, device_s=0.02, key="a")
    session.transfer("d2h", GB, 1.0, 1.02, device_s=0.02, key="b")
    session.transfer("read", GB, 2.0, 3.0, key="c")
    session.transfer("read", GB, 2.5, 3.5, key="d")
    session.commit(backward_end=4.0, at=5.0, step=1)
    profiler.stop()
    summary = profiler.summary()
    for paths in (summary["steps"][0]["paths"], summary["totals"]["paths"]):
        assert paths["d2h"]["busy_s"] == pytest.approx(0.04)
        assert paths["d2h"]["gbps"] == pytest.approx(50.0) and paths["d2h"]["of_ceiling"] == pytest.approx(1.0)
        assert paths["read"]["busy_s"] == pytest.approx(1.5) and paths["read"]["of_ceiling"] == pytest.approx(2 / 1.5 / 2.0)
        assert not any(p["over_ceiling"] for p in paths.values())
    assert "100%" in format_report(summary) and ">100%" not in format_report(summary)


def test_rate_past_the_event_cap_uses_only_the_recorded_copies(fake):
    """Past the recording cap the counters still count bytes, but those copies' times are not kept: the rate
    is the recorded copies' bytes over their busy time, never all bytes over part of the time."""
    session, profiler = fake
    profiler.ceilings_gbps = {"d2h": 50.0}
    profiler.max_events = 1
    session.transfer("d2h", GB, 0.0, 0.02, device_s=0.02)
    session.transfer("d2h", GB, 0.02, 0.04, device_s=0.02)  # counted, not recorded
    profiler.stop()
    d2h = profiler.summary()["totals"]["paths"]["d2h"]
    assert d2h["nbytes"] == 2 * GB and d2h["recorded_nbytes"] == GB
    assert d2h["gbps"] == pytest.approx(50.0) and d2h["of_ceiling"] == pytest.approx(1.0)


def test_report_flags_a_share_above_the_ceiling_instead_of_printing_it(fake):
    session, profiler = fake
    profiler.ceilings_gbps = {"d2h": 25.5, "h2d": 49.5}  # d2h: a probe at half the link; h2d: within the noise
    session.transfer("d2h", GB, 0.0, 0.02, device_s=0.02)
    session.transfer("h2d", GB, 0.0, 0.02, device_s=0.02)
    profiler.stop()
    summary = profiler.summary()
    paths = summary["totals"]["paths"]
    assert paths["d2h"]["of_ceiling"] == pytest.approx(50 / 25.5) and paths["d2h"]["over_ceiling"]  # kept as measured
    assert paths["h2d"]["of_ceiling"] == pytest.approx(50 / 49.5) and not paths["h2d"]["over_ceiling"]
    report = format_report(summary)
    d2h_line = next(line for line in report.splitlines() if line.startswith("device -> pinned"))  # META: a CPU run
    h2d_line = next(line for line in report.splitlines() if line.startswith("pinned -> device"))
    assert d2h_line.endswith(OVER_CEILING_MARK) and "196%" not in report
    assert h2d_line.endswith(" 100%")
    assert OVER_CEILING_NOTE in report


def test_share_text():
    assert [share_text(s) for s in (None, 0.874, 1.0, 1.0 + CEILING_NOISE, 1.5)] == ["-", "87%", "100%", "100%", OVER_CEILING_MARK]


def test_stalls_by_cause_and_block(fake):
    session, profiler = fake
    two_steps(session)
    summary = profiler.summary()
    s1, s2 = summary["steps"]
    assert s1["stall_s"][STALL_FETCH_HOST] == pytest.approx(0.75) and s1["stall_s"][STALL_UPDATE] == 0.0
    assert s2["stall_s"][STALL_UPDATE] == pytest.approx(1.0) and s2["stall_s"][STALL_CAPACITY] == pytest.approx(0.75)
    assert s1["top_blocks"][0][:2] == [1, STALL_FETCH_HOST]
    assert summary["totals"]["stall_s"][STALL_FETCH_HOST] == pytest.approx(0.75)
    top = summary["top_blocks"]
    assert top[0]["block"] == 0 and top[0]["seconds"] == pytest.approx(1.25)
    assert top[0]["by_cause"] == {STALL_FETCH_HOST: pytest.approx(0.25), STALL_UPDATE: pytest.approx(1.0)}
    assert summary["steady"]["stall_s"][STALL_UPDATE] == pytest.approx(1.0)  # steps after the first
    assert summary["steady"]["update_stall_by_block"] == {"0": pytest.approx(1.0)}


def test_the_steady_state_leaves_out_the_steps_auto_placement_measured(fake):
    """Auto placement's measured steps (one, or two with a recompute trial) update on the CPU: a steady state
    starts after them (runtime.profiler.collect's meta says how many)."""
    from runtime.profiler.analysis import _unsteady_steps, steady_state

    session, profiler = fake
    two_steps(session)
    s1, s2 = profiler.summary()["steps"]
    assert steady_state([s1, s2, s1])["stall_s"][STALL_UPDATE] == pytest.approx(0.5)  # steps 2 and 3
    assert steady_state([s1, s2, s1], skip=2)["stall_s"][STALL_UPDATE] == 0.0  # step 3 alone
    assert steady_state([s1, s2], skip=2)["stall_s"][STALL_UPDATE] == pytest.approx(1.0)  # the last one
    numbers = [1, 2, 3, 4]
    assert [_unsteady_steps(meta, numbers) for meta in ({}, {"placement_steps": 1}, {"placement_steps": 2})] == [1, 1, 2]
    assert _unsteady_steps({"placement_steps": 2}, [4, 5, 6]) == 1  # a profile begun after the measured steps


def test_adam_overlap_with_gpu_work(fake):
    session, profiler = fake
    two_steps(session)
    summary = profiler.summary()
    s1 = summary["steps"][0]
    # Adam of step 1: [6, 9] and [10, 12] = 5 s. GPU work: [0.5, 8] and [11, 18] minus stalls
    # ([1, 1.25], [2, 2.5], [11, 12], [15, 15.75]): [6, 8] overlaps 2 s; [10, 12] overlaps nothing
    # (11..12 is the forward waiting for that very update).
    assert s1["adam_s"] == pytest.approx(5.0)
    assert s1["adam_hidden_s"] == pytest.approx(2.0)
    assert summary["steps"][1]["adam_s"] == 0.0
    assert summary["totals"]["adam_s"] == pytest.approx(5.0)


def test_listeners_are_removed_and_intervals_restored(fake):
    session, profiler = fake
    assert session.controller.worker.record_intervals is True
    profiler.stop()
    assert session.controller.stall_listeners == [] and session.controller.step_listeners == []
    assert session.controller.worker.record_intervals is False
    session.transfer("h2d", 5, 0.0, 1.0)
    assert profiler.raw().counters.nbytes == {}


def test_event_cap_keeps_counting(fake, monkeypatch):
    session, profiler = fake
    profiler.max_events = 1
    session.transfer("read", 10, 0.0, 1.0)
    session.transfer("read", 20, 1.0, 2.0)
    raw = profiler.raw()
    assert len(raw.transfers) == 1 and raw.dropped_events == 1 and raw.counters.nbytes["read"] == 30


def test_trace_event_format(fake):
    session, profiler = fake
    two_steps(session)
    trace = json.loads(json.dumps(chrome_trace(profiler.raw())))
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    for _, track in tracks("cpu").values():  # META: a CPU run
        assert track in names
    assert not any("GPU" in name for name in names)
    assert {track for _, track in TRACKS.values()} - {track for _, track in tracks("cuda").values()} == set()
    assert "NVMe read #2" in names  # the overlapping reads go to two lanes
    complete = [e for e in events if e["ph"] == "X"]
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= e.keys() and e["ts"] >= 0 and e["dur"] >= 0
    h2d = sorted((e for e in complete if e["cat"] == "h2d"), key=lambda e: e["ts"])
    assert h2d[0]["ts"] == pytest.approx(2.5e6) and h2d[0]["dur"] == pytest.approx(0.5e6)  # microseconds from start
    assert sum(1 for e in complete if e["cat"] in ("h2d", "d2h", "read", "write")) == 7
    assert sum(1 for e in complete if e["cat"] == "stall") == 4
    assert sum(1 for e in complete if e["cat"] == "adam") == 2
    assert sum(1 for e in complete if e["cat"] == "step") == 2


def _steady(**stalls: float) -> dict[str, Any]:
    causes = {c: stalls.get(c, 0.0) for c in ("fetch_host", "fetch_nvme", "update", "capacity")}
    return {"steps": 3, "first_step": 2, "step_s": 1.0, "compute_s": 0.8, "paths": {}, "hit_rate": 0.5,
            "stall_s": causes, "device_wait_s": dict.fromkeys(causes, 0.0), "adam_s": 0.5, "adam_hidden_s": 0.1,
            "adam_wait_inputs_s": stalls.get("inputs", 0.0), "update_stall_by_block": stalls.get("by_block", {})}


def test_advice_targets_the_dominant_cause():
    base = {**META, "totals": {"paths": {}}}
    advice = advise({**base, "steady": _steady(fetch_host=0.3)})
    assert advice[0]["change"].startswith("raise prefetch.depth from 2 to 4")
    assert advice[0]["saves_s"] == pytest.approx(0.3)
    assert "would remove up to 0.300 s/step of the 0.300 s/step" in advice[0]["text"]

    advice = advise({**base, "steady": _steady(update=0.4, inputs=0.1, by_block={"0": 0.35, "3": 0.05})})
    changes = [a["change"] for a in advice]
    assert any(c.startswith("move placement.moments from nvme to host") for c in changes)
    fraction = next(a for a in advice if "gpu_update_fraction" in a["change"])
    assert "from 0.00 to 0.25" in fraction["change"]  # block 0 holds 87% of the update stall: the first quarter
    assert fraction["saves_s"] == pytest.approx(0.35)
    moments = next(a for a in advice if "moments" in a["change"])
    assert moments["saves_s"] == pytest.approx(0.1)
    assert advice == sorted(advice, key=lambda a: -a["saves_s"])

    advice = advise({**base, "steady": _steady(capacity=0.2)})
    assert advice[0]["change"].startswith("raise tiers.gpu.budget")

    advice = advise({**base, "steady": _steady(fetch_host=0.001)})
    assert advice[0]["change"] == "none"


def test_report_and_saved_outputs(fake, tmp_path):
    session, profiler = fake
    two_steps(session)
    profiler.stop()
    saved = profiler.save(tmp_path / "prof")
    summary = json.loads((tmp_path / "prof" / "summary.json").read_text())
    assert summary["version"] == 1 and len(summary["steps"]) == 2
    report = (tmp_path / "prof" / "report.txt").read_text()
    assert report == format_report(summary)
    assert "traffic per path" in report and "advice" in report and "layers.0" in report
    json.loads(saved.files["trace"].read_text())


def test_plot_skip_is_reported_without_matplotlib(fake, tmp_path, monkeypatch, caplog):
    session, profiler = fake
    two_steps(session)
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg", "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, name, None)  # import of each now raises ImportError
    with caplog.at_level(logging.INFO, logger="runtime.profiler"):
        saved = save_profile(profiler.raw(), tmp_path)
    assert "plot" not in saved.files and "matplotlib" in saved.skipped["plot"]
    assert not (tmp_path / "plot.png").exists()
    assert any("plot skipped" in r.getMessage() for r in caplog.records)
    assert "not written: plot" in (tmp_path / "report.txt").read_text()


def test_plot_is_a_png_when_matplotlib_is_installed(fake, tmp_path):
    pytest.importorskip("matplotlib")
    session, profiler = fake
    two_steps(session)
    saved = save_profile(profiler.raw(), tmp_path)
    assert saved.files["plot"].read_bytes().startswith(PNG_SIGNATURE)


def test_ceilings_from_store_bench_and_measured(tmpfs_dir):
    results = {"device": "x", "results": [{"path": "host->gpu", "raw_gbps": 50.0}, {"path": "gpu->host", "raw_gbps": 40.0},
                                          {"path": "nvme->host", "raw_gbps": 1.5}, {"path": "host->nvme", "raw_gbps": 1.2}]}
    assert ceilings_from_store_bench(results) == {"h2d": 50.0, "d2h": 40.0, "read": 1.5, "write": 1.2}
    with TierStore(StoreConfig(nvme_path=str(tmpfs_dir), host_budget_nbytes=1 << 20)) as store:
        ceilings = measure_ceilings(store, nbytes=1 << 20, repeats=1, disk_nbytes=4 << 20)
    assert set(ceilings) == {"h2d", "d2h", "read", "write"} and all(v > 0 for v in ceilings.values())
    assert not any(p.name.startswith(".tierstore-ceiling") for p in tmpfs_dir.iterdir())


def test_ceiling_probe_never_writes_through_a_planted_link(nvme_dir, tmp_path_factory):
    """The old probe name, linked to another file: the probe writes in a private directory of its own."""
    victim = tmp_path_factory.mktemp("victims") / "victim"
    victim.write_bytes(b"someone else's file\n")
    (nvme_dir / ".tierstore-ceiling-probe").symlink_to(victim)
    with TierStore(StoreConfig(nvme_path=str(nvme_dir), host_budget_nbytes=1 << 20)) as store:
        assert measure_ceilings(store, nbytes=1 << 20, repeats=1, disk_nbytes=4 << 20)["write"] > 0
    assert victim.read_bytes() == b"someone else's file\n"
    assert sorted(p.name for p in nvme_dir.iterdir() if not p.name.endswith(".lock")) == [".tierstore-ceiling-probe"]


def test_saved_profile_files_never_write_through_planted_links(fake, tmp_path):
    """Links planted at every name a saved profile writes (trace, report, summary, plot) point at other files:
    the links are removed and the profile written as new files; the victims are unchanged. They had been written
    through (Path.write_text follows a link)."""
    session, profiler = fake
    two_steps(session)
    profiler.stop()
    out, victims = tmp_path / "prof", tmp_path / "victims"
    out.mkdir()
    victims.mkdir()
    names = ("trace.json", "report.txt", "summary.json", "plot.png")
    for name in names:
        (victims / name).write_bytes(b"someone else's file\n")
        (out / name).symlink_to(victims / name)
    saved = profiler.save(out)
    for name in names:
        assert (victims / name).read_bytes() == b"someone else's file\n", name
    for path in saved.files.values():
        assert path.is_file() and not path.is_symlink(), path
    assert json.loads((out / "summary.json").read_text())["version"] == 1
    saved = profiler.save(out)  # again into the same directory: the earlier profile's files are replaced
    assert json.loads((out / "summary.json").read_text())["version"] == 1


def test_a_profile_directory_that_cannot_hold_a_profile_is_refused_before_training(tmp_path, capsys):
    """``tierstore train --profile FILE``: refused with exit status 2 and one line naming it, before the model is
    built (it had trained every step, then failed with a FileExistsError traceback and status 1)."""
    from runtime.cli import main as cli

    target = tmp_path / "a_file"
    target.write_text("not a directory")
    assert cli.main(["train", "--steps", "1", "--profile", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"profile directory {target} is a file" in err and "tierstore train:" not in err


def test_a_failing_controller_listener_is_logged_not_raised(caplog):
    def broken(event: object) -> None:
        raise ValueError("profiler bug")

    with caplog.at_level(logging.ERROR):
        emit([broken], StepEvent("commit", 1, 0.0))
    assert "profiler bug" in caplog.text


def test_profiler_cannot_start_twice(fake):
    _, profiler = fake
    with pytest.raises(RuntimeError, match="already running"):
        profiler.start()


def _llama8b_meta(*, embedding_on_gpu: bool, reserve_gib: float, plan_gib: float, keep_gib: float, peak_gib: float,
                  fraction_auto: bool = True) -> dict[str, Any]:
    """The 8B scenario's blocks (embedding, 32 layers, head) on a 24 GiB GPU with moments spilled to NVMe."""
    gib = 2**30
    numels = [525_336_576] + [218_112_000] * 32 + [525_336_576]
    blocks = [{"index": i, "name": name, "numel": n, "weight_nbytes": 2 * n, "source_key": f"b{i}.master",
               "gpu_updated": embedding_on_gpu and i == 0}
              for i, (n, name) in enumerate(zip(numels, ["embed"] + [f"layers.{i}" for i in range(32)] + ["head"], strict=True))]
    config = {**META["config"], "homes": {**META["config"]["homes"], "exp_avg": "host+nvme", "exp_avg_sq": "host+nvme"},
              "gpu_update_fraction": 0.0654 if embedding_on_gpu else 0.0, "gpu_update_fraction_auto": fraction_auto,
              "gpu_budget_nbytes": 24 * gib, "activation_reserve_nbytes": int(reserve_gib * gib),
              "gpu_plan_nbytes": int(plan_gib * gib), "keep_for_backward_nbytes": int(keep_gib * gib)}
    return {**META, "device_type": "cuda", "config": config, "blocks": blocks, "totals": {"paths": {}},
            "memory": {"host_available_nbytes": 20 * gib, "moments_offloaded_nbytes": int(29.3 * gib),
                       "gpu_peak_nbytes": int(peak_gib * gib)}}


def _spilled_update_stall() -> dict[str, Any]:
    return _steady(update=20.0, inputs=18.0, by_block={str(i): 2.5 for i in range(25, 33)})


def test_a_reserve_probe_with_more_blocks_on_the_gpu_is_advised():
    """The probe's answer becomes the advice: the reserve, the blocks auto placement then updates on the GPU,
    and the NVMe wait their host state frees (8.4 GB of 29.3 GiB of spilled moments)."""
    gib = 2**30
    summary = {**_llama8b_meta(embedding_on_gpu=False, reserve_gib=10.1, plan_gib=10.5, keep_gib=3.0, peak_gib=12.0),
               "steady": _spilled_update_stall()}
    summary["memory"]["reserve_probe"] = {"reserve_nbytes": int(2.5 * gib), "beyond_plan_nbytes": 0, "updated": 1, "baseline_updated": 0,
                                          "streamed": 0, "keep_for_backward_nbytes": 3 * gib}
    advice = advise(summary)
    reserve = next(a for a in advice if "activation_reserve" in a["change"])
    assert reserve["change"].startswith("lower tiers.gpu.activation_reserve from 10.1 GiB to 2.5 GiB: auto placement "
                                        "then updates 1 more block(s) on the GPU (embed)")
    assert reserve["saves_s"] == pytest.approx(18.0 * 16 * 525_336_576 / (29.3 * gib), rel=1e-6)
    assert not any("gpu_update_fraction" in a["change"] for a in advice)  # auto chooses the blocks, not the user
    summary["memory"]["reserve_probe"] = None  # the peak supports no lower reserve: no reserve advice, and no
    changes = [a["change"] for a in advise(summary)]  # 'raise gpu_update_fraction to 0.95, 88 GiB more' either
    assert changes and not any("activation_reserve" in c or "gpu_update_fraction" in c for c in changes), changes


@pytest.mark.parametrize("peak_gib,fits", [(20.8, False), (18.5, True)])
def test_a_larger_micro_batch_is_advised_only_where_its_activations_fit(peak_gib, fits):
    """The backward waited 10 s a step for host-sum buffers. The 8B scenario's peak (20.8 GiB of 24 against a
    15.7 GiB plan: 5.1 GiB of activations, 2.0 GiB left beside the 5% margin) has no room for a micro-batch twice as
    large: the advice says so and promises nothing; at 18.5 GiB (2.8 GiB of activations, 4.3 left) it names the
    change with the wait as its bound. Without a measured peak (the CPU) it names the change as before."""
    meta = _llama8b_meta(embedding_on_gpu=True, reserve_gib=6.0, plan_gib=15.7, keep_gib=0.0, peak_gib=peak_gib)
    steady = _steady()
    steady["stall_s"]["grad_sum"], steady["device_wait_s"]["grad_sum"] = 10.0, 0.0
    advice = advise({**meta, "steady": steady})
    item = next(a for a in advice if "micro-batch size" in a["change"])
    if fits:
        assert item["change"].startswith("raise the micro-batch size") and item["saves_s"] == pytest.approx(10.0)
    else:
        assert item["change"].startswith("keep the micro-batch size") and item["saves_s"] == 0.0
        assert "would remove nothing" in item["text"] and "5.1 GiB more" in item["text"], item["text"]
        assert "left 2.0 GiB free" in item["text"], item["text"]
    on_cpu = advise({**meta, "device_type": "cpu", "steady": steady})
    assert next(a for a in on_cpu if "micro-batch size" in a["change"])["change"].startswith("raise")


def test_with_a_set_update_fraction_the_advice_is_capped_by_the_measured_peak():
    """gpu_update_fraction written by hand: the advice raises it only to the blocks that fit beside the peak, with
    a fraction that selects exactly them."""
    from runtime.planning.auto_placement import blocks_within

    meta = _llama8b_meta(embedding_on_gpu=True, reserve_gib=5.0, plan_gib=12.0, keep_gib=0.0, peak_gib=12.5,
                         fraction_auto=False)
    advice = advise({**meta, "steady": _spilled_update_stall()})
    raise_it = next(a for a in advice if "gpu_update_fraction" in a["change"])
    fraction = float(raise_it["change"].split(" to ")[1].split(" ")[0])
    from runtime.planning.peak_hint import GPU_MARGIN

    room = 24 - 12.5 - GPU_MARGIN * 24  # GiB: 10.3 at a 5% margin, three layers of 3.25 GiB
    assert blocks_within([b["numel"] for b in meta["blocks"]], fraction) == 1 + int(room // 3.25)
    assert "the step's peak left" in raise_it["change"]


def test_the_report_says_when_the_layers_activations_were_recomputed(fake):
    session, profiler = fake
    two_steps(session)
    summary = profiler.summary()  # this fake's meta predates the key: the line says nothing of it
    assert "activations recomputed" not in format_report(summary)
    summary["config"]["activations_recomputed"] = False
    assert "activations recomputed" not in format_report(summary)
    summary["config"]["activations_recomputed"] = True
    assert "accumulation 1; activations recomputed" in format_report(summary).splitlines()[1]


def test_a_fetch_stalls_device_wait_sums_the_pieces_its_fetch_issued():
    """A fetch from the fp32 master crosses in pieces, one transfer event each ([Note: fetch staging]): the stall's
    estimated device wait is every piece issued inside it, not the first alone; pieces of other fetches of the
    same block (before or after the stall) and update stalls get none."""
    from runtime.profiler.analysis import device_waits

    def piece(start_s: float, device_s: float, key: str = "b1.master") -> TransferEvent:
        return TransferEvent("h2d", key, "host", "gpu", 1 << 20, start_s, start_s + 0.01, device_s)

    stalls = [StallEvent(1, STALL_FETCH_HOST, 0.5, 0, start_s=10.0), StallEvent(1, STALL_UPDATE, 0.5, 0, start_s=10.0)]
    transfers = [piece(9.0, 0.4), piece(10.1, 0.02), piece(10.2, 0.03), piece(10.3, 0.05), piece(10.2, 0.9, "b2.master"),
                 piece(11.0, 0.7)]
    waits = device_waits(stalls, transfers, {1: "b1.master", 2: "b2.master"})
    assert waits == {0: pytest.approx(0.10)}


def test_the_advice_counts_the_host_gradient_of_the_run_s_dtype():
    """What a host-updated block holds in pinned memory, a parameter: fp32 master and moments (12 bytes), its host
    gradient (4 bytes in fp32, 2 in bf16: optimizer.host_grad_dtype; fp32 in profiles without the key) and the
    weights copy where there is one."""
    from runtime.profiler.advice import host_state_itemsize

    assert host_state_itemsize({}) == 16
    assert host_state_itemsize({"host_grad_itemsize": 2}) == 14
    assert host_state_itemsize({"host_grad_itemsize": 2, "weight_source": "weights"}) == 16
    assert host_state_itemsize({"host_grad_itemsize": 2, "weight_source": "weights"}, weights_copy=False) == 14
