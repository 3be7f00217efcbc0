"""A real short training run under the profiler: its counters equal the store's own events, every output is
written and readable, and ``tierstore profile DIR`` prints the report."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from collections import defaultdict

import pytest
import torch

from runtime import offload
from runtime.bundled.data import ByteBatches, stdlib_text_bytes
from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.cli.main import main as cli_main
from runtime.core.events import STALL_CAPACITY, STALL_FETCH_HOST, STALL_FETCH_NVME, STALL_UPDATE
from runtime.profiler import Profiler, format_report
from runtime.profiler.outputs import PNG_SIGNATURE
from runtime.profiler.outputs import tracks as named_tracks
from tierstore import TierName, TransferEvent

SHAPE = ModelShape(vocab_size=256, hidden_size=32, num_layers=3, num_heads=4, ffn_size=64, max_seq_len=64)
STEPS = 4
PATHS = ("h2d", "d2h", "read", "write")


class EventTotals:
    """An independent listener: bytes and count of every event the store publishes, by kind."""

    def __init__(self) -> None:
        self.nbytes: dict[str, int] = defaultdict(int)
        self.count: dict[str, int] = defaultdict(int)

    def __call__(self, event: TransferEvent) -> None:
        self.nbytes[event.kind] += event.nbytes
        self.count[event.kind] += 1


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: ByteBatches, steps: int) -> None:
    """``steps`` steps of the user's plain loop on the next batches of ``data``."""
    device = optimizer.session.store.device  # type: ignore[attr-defined]
    for _ in range(steps):
        x, y = data.next()
        model(x.to(device), y.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory):
    """Train 4 steps with master on host and moments on an NVMe tier in tmp, profiled; save the profile."""
    nvme = tmp_path_factory.mktemp("nvme")
    out = tmp_path_factory.mktemp("profile")
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    config = {"dtype": "fp32", "tiers": {"nvme": {"path": str(nvme)}}, "optimizer": {"grad_clip": None},
              "placement": {"weights": "host", "master": "host", "moments": "nvme"}}
    model, optimizer = offload(model, config)
    session = optimizer.session
    totals = EventTotals()
    profiler = Profiler(session, ceilings={"h2d": 10.0, "d2h": 10.0, "read": 2.0, "write": 2.0}).start()
    session.store.bus.subscribe(totals)
    data = ByteBatches(stdlib_text_bytes(1 << 20), batch_size=2, seq_len=32, seed=0)
    try:
        _train(model, optimizer, data, STEPS)
        optimizer.synchronize()
        stats = session.controller.stats
        schedule = session.controller.schedule.stats
        counted = {"wait_update_s": stats.wait_update_s, "wait_fetch_s": stats.wait_fetch_s,
                   "hits": schedule.hits, "misses": schedule.misses}
    finally:
        session.close()  # the last write-backs land here: both listeners still hear them
    profiler.stop()
    saved = profiler.save(out)
    return profiler, totals, counted, saved, out


def test_byte_counters_equal_the_store_events(profiled):
    profiler, totals, _, _, _ = profiled
    raw = profiler.raw()
    for kind in PATHS:
        assert totals.nbytes[kind] > 0, f"no bytes moved on {kind}: the test does not exercise every path"
    assert dict(raw.counters.nbytes) == dict(totals.nbytes)
    assert dict(raw.counters.count) == dict(totals.count)
    summary = profiler.summary()
    for kind in PATHS:
        assert summary["totals"]["paths"][kind]["nbytes"] == totals.nbytes[kind]
        steps_nbytes = sum(s["paths"][kind]["nbytes"] for s in summary["steps"])
        tail = totals.nbytes[kind] - raw.marks[-1].counters.nbytes.get(kind, 0)  # after the last commit
        assert steps_nbytes + tail == totals.nbytes[kind]


def test_stalls_and_hits_match_the_controller(profiled):
    profiler, _, counted, _, _ = profiled
    summary = profiler.summary()
    assert len(summary["steps"]) == STEPS
    assert summary["totals"]["stall_s"][STALL_UPDATE] == pytest.approx(counted["wait_update_s"], abs=1e-9)
    fetch = sum(summary["totals"]["stall_s"][c] for c in (STALL_FETCH_HOST, STALL_FETCH_NVME, STALL_CAPACITY))
    assert fetch == pytest.approx(counted["wait_fetch_s"], abs=1e-9)
    assert sum(s["hits"] for s in summary["steps"]) == counted["hits"]
    assert sum(s["misses"] for s in summary["steps"]) == counted["misses"]
    assert summary["steps"][0]["misses"] > 0  # the first step learns the schedule: every fetch is on demand
    assert summary["totals"]["stall_s"][STALL_FETCH_HOST] > 0
    assert summary["totals"]["adam_s"] > 0 and summary["steps"][0]["usage_nbytes"]["nvme"] > 0
    assert summary["config"]["activations_recomputed"] is False and summary["placement_steps"] == 0  # on the CPU


def test_outputs_are_written_and_valid(profiled):
    _, totals, _, saved, out = profiled
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"]
    assert isinstance(events, list)
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    device_type = json.loads((out / "summary.json").read_text())["device_type"]
    for _, name in named_tracks(device_type).values():  # a CPU run's tracks say "device", not "GPU"
        assert name in tracks
    complete = [e for e in events if e["ph"] == "X"]
    assert all({"name", "ts", "dur", "pid", "tid"} <= e.keys() and e["ts"] >= 0 and e["dur"] >= 0 for e in complete)
    for kind in PATHS:
        assert sum(1 for e in complete if e["cat"] == kind) == totals.count[kind]
    assert any(e["cat"] == "adam" for e in complete) and any(e["cat"] == "stall" for e in complete)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["totals"]["steps"] == STEPS and summary["advice"]
    assert (out / "report.txt").read_text().strip()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "plot.png").read_bytes().startswith(PNG_SIGNATURE)
    else:
        assert "matplotlib" in saved.skipped["plot"] and summary["skipped"]["plot"]
        assert not (out / "plot.png").exists()


def test_profile_command_prints_the_report(profiled, capsys):
    _, _, _, _, out = profiled
    assert cli_main(["profile", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "traffic per path" in printed and "per step" in printed and "advice" in printed
    assert printed == (out / "report.txt").read_text()


def test_profile_command_draws_the_plot_later(profiled, capsys, monkeypatch):
    """`tierstore profile DIR --plot` draws plot.png from the saved summary, or says what to install."""
    import runtime.profiler as profiler

    _, _, _, _, out = profiled
    drawn = []

    def fake_plot(summary, path):
        drawn.append((summary["steps"], path))
        path.write_bytes(b"png")
        return True

    monkeypatch.setattr(profiler, "write_plot", fake_plot)
    assert cli_main(["profile", str(out), "--plot"]) == 0
    assert drawn and drawn[0][1] == out / "plot.png" and "plot written" in capsys.readouterr().out
    monkeypatch.setattr(profiler, "write_plot", lambda summary, path: False)
    assert cli_main(["profile", str(out), "--plot"]) == 2
    assert "needs matplotlib" in capsys.readouterr().err


@pytest.mark.slow
def test_train_command_writes_a_profile(tmp_path, tmpfs_dir, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(textwrap.dedent(f"""\
        dtype: fp32
        tiers:
          nvme: {{path: {tmpfs_dir}}}
        placement: {{weights: host, master: host, moments: nvme}}
        train:
          steps: 3
          batch_size: 2
          seq_len: 32
          model: {{hidden_size: 32, num_layers: 2, num_heads: 4, ffn_size: 64, max_seq_len: 64}}
        """))
    out = tmp_path / "prof"
    assert cli_main(["train", "--config", str(config), "--profile", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["totals"]["steps"] == 3
    assert all(summary["totals"]["paths"][k]["nbytes"] > 0 for k in PATHS)
    assert summary["ceilings_gbps"].keys() >= set(PATHS)  # measured at start
    assert (out / "trace.json").is_file() and (out / "report.txt").is_file()


def test_a_full_gpu_budget_is_reported_as_its_own_cause():
    # fp32 weights: 41,216 bytes per layer block, 65,664 for the rest (embedding, norm, head). 130,000 bytes
    # hold the rest plus one layer: prefetches four deep are refused, and those blocks are fetched on demand.
    # A budget that small is refused by the plan, so the plan gets 1 MiB and all but 130,000 bytes of it are
    # taken by another user of the device (as memory the user's own code allocates would be).
    shape = ModelShape(vocab_size=256, hidden_size=32, num_layers=4, num_heads=4, ffn_size=64, max_seq_len=64)
    torch.manual_seed(0)
    model, optimizer = offload(ExampleLM(shape), {"dtype": "fp32", "optimizer": {"grad_clip": None},
                                                  "prefetch": {"depth": 4}, "tiers": {"gpu": {"budget": 1 << 20}}})
    session = optimizer.session
    session.store.tiers[TierName.GPU].reserve((1 << 20) - 130_000, "another user of the device")
    profiler = Profiler(session).start()
    data = ByteBatches(stdlib_text_bytes(1 << 20), batch_size=2, seq_len=32, seed=0)
    try:
        # On the CPU the refusal that shows up is the worker's fetch of block 0 the moment its update lands while
        # the forward waits for it (the budget is full then); whether the forward is already waiting is a race
        # between the two threads (about one step in six misses it, measured), so six steps, not three.
        _train(model, optimizer, data, 6)
        wait_fetch_s = session.controller.stats.wait_fetch_s
    finally:
        session.close()
    profiler.stop()
    summary = profiler.summary()
    stalls = summary["totals"]["stall_s"]
    assert stalls[STALL_CAPACITY] > 0
    assert stalls[STALL_CAPACITY] + stalls[STALL_FETCH_HOST] + stalls[STALL_FETCH_NVME] == pytest.approx(wait_fetch_s, abs=1e-9)


def test_the_report_splits_cpu_adam_into_kernel_and_clip_factors():
    """Every step clips (max norm 1e-3): the host updates wait for the commit and multiply their gradients by the
    coefficient; the profile counts that apart from the kernel, within the Adam time it reports."""
    torch.manual_seed(0)
    model, optimizer = offload(ExampleLM(SHAPE), {"dtype": "fp32", "optimizer": {"grad_clip": 1e-3}})
    session = optimizer.session
    profiler = Profiler(session)
    assert profiler.raw().adam_split_s == {}  # nothing recorded before start()
    data = ByteBatches(stdlib_text_bytes(1 << 20), batch_size=2, seq_len=32, seed=0)

    def train(steps: int) -> None:
        _train(model, optimizer, data, steps)
        optimizer.synchronize()

    try:
        train(1)  # before the profile: subtracted
        worker = session.controller.worker.stats
        before = {"kernel_s": worker.kernel_s, "scale_s": worker.scale_s, "refresh_s": worker.refresh_s}
        profiler.start()
        train(3)
        expected = {k: v - before[k] for k, v in
                    {"kernel_s": worker.kernel_s, "scale_s": worker.scale_s, "refresh_s": worker.refresh_s}.items()}
        profiler.stop()
        train(1)  # after the profile: not counted
    finally:
        session.close()
    summary = profiler.summary()
    split = summary["totals"]["adam_split_s"]
    assert split == pytest.approx(expected)  # the profile's window only
    assert split["kernel_s"] > 0
    assert split["kernel_s"] + split["scale_s"] + split["refresh_s"] <= summary["totals"]["adam_s"] + 1e-9
    assert "CPU Adam's parts: AdamW kernel" in format_report(summary)
