"""runtime.planning.peak_hint: after the first steps, the reserve the measured GPU peak supports and what auto placement
chooses with it, logged once, only when that puts more blocks on the GPU than auto placement asked again at
the reserve it has."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from runtime.core.events import StepEvent
from runtime.planning.auto_placement import Placement
from runtime.planning.peak_hint import GPU_MARGIN, PeakHint, reserve_probe

GIB = 2**30
NUMELS = [525_336_576] + [218_112_000] * 32 + [525_336_576]  # Llama-3-8B: embedding, 32 layers, head
BLOCKS = [SimpleNamespace(index=i, numel=n) for i, n in enumerate(NUMELS)]
CONFIG = {"gpu_update_fraction_auto": True, "keep_auto": True, "activation_reserve_auto": True,
          "activation_reserve_nbytes": int(10.1 * GIB), "gpu_budget_nbytes": 24 * GIB,
          "gpu_plan_nbytes": int(10.5 * GIB), "keep_for_backward_nbytes": 3 * GIB, "measured_first_step": False}


def ask(reserve: int) -> Placement:
    """Auto placement of the 8B under 24 GiB: below 5 GiB of reserve the embedding is updated on the GPU."""
    return Placement(NUMELS[0] / sum(NUMELS) + 1e-9 if reserve < 5 * GIB else 0.0, 0.0, 3 * GIB)


def test_the_probe_asks_auto_placement_at_the_reserve_the_peak_supports_and_at_its_own():
    """Peak 12 GiB with 10.5 planned and 3 kept by auto: nothing beyond the plan, so the reserve is the 5% margin
    (1.2 GiB, up to 1.25). A hand-set keep counts as the activations' room; a hand-set fraction, no peak, no
    lower reserve or a session no longer there: no probe."""
    asked = []
    probe = reserve_probe(CONFIG, 12 * GIB, BLOCKS, lambda r: asked.append(r) or ask(r))
    assert GPU_MARGIN == 0.05 and asked == [int(1.25 * GIB), int(10.1 * GIB)]
    assert probe["reserve_nbytes"] == int(1.25 * GIB) and probe["beyond_plan_nbytes"] == 0
    assert (probe["baseline_updated"], probe["updated"], probe["streamed"]) == (0, 1, 0)
    probe = reserve_probe({**CONFIG, "keep_auto": False}, 15 * GIB, BLOCKS, ask)  # 4.5 GiB beyond the plan
    assert probe["beyond_plan_nbytes"] == int(4.5 * GIB) and probe["reserve_nbytes"] == int(5.75 * GIB)
    assert reserve_probe({**CONFIG, "gpu_update_fraction_auto": False}, 12 * GIB, BLOCKS, ask) is None
    assert reserve_probe(CONFIG, None, BLOCKS, ask) is None
    assert reserve_probe({**CONFIG, "measured_first_step": True}, 12 * GIB, BLOCKS, ask) is None  # reserve measured
    assert reserve_probe(CONFIG, 23 * GIB, BLOCKS, ask) is None  # 9.5 beyond + 1.2: not below 10.1
    assert reserve_probe(CONFIG, 12 * GIB, BLOCKS, lambda r: None) is None


def hint_lines(caplog, hint: PeakHint, steps: int) -> list[str]:
    with caplog.at_level(logging.INFO, logger="runtime.planning.peak_hint"):
        hint(StepEvent("begin", 0, 0.0, "train"))
        for step in range(1, steps + 1):
            hint(StepEvent("commit", step, float(step)))
    return [r.getMessage() for r in caplog.records if r.name == "runtime.planning.peak_hint"]


def test_after_two_steps_the_reserve_is_logged_once(caplog):
    peaks = iter([1 * GIB, 12 * GIB, 13 * GIB])  # setup, then read once: at the second commit
    lines = hint_lines(caplog, PeakHint(CONFIG, BLOCKS, ask, lambda: next(peaks)), steps=4)
    assert len(lines) == 1, lines
    assert "the first 2 steps peaked at 12.00 GiB of the 24.00 GiB GPU budget" in lines[0]
    assert "tiers.gpu.activation_reserve: 1.25 GiB (auto: 10.10 GiB) would update 1 more block(s)" in lines[0]


def test_no_line_when_the_peak_is_unknown_nothing_more_fits_or_the_reserve_was_set(caplog):
    setup_peak = PeakHint(CONFIG, BLOCKS, ask, lambda: 12 * GIB)  # the steps never passed setup's peak
    same = PeakHint(CONFIG, BLOCKS, lambda r: ask(0), iter([GIB, 12 * GIB]).__next__)  # the embedding either way
    chosen = PeakHint({**CONFIG, "activation_reserve_auto": False}, BLOCKS, ask, iter([GIB, 12 * GIB]).__next__)
    gone = PeakHint(CONFIG, BLOCKS, lambda r: None, iter([GIB, 12 * GIB]).__next__)
    for hint in (setup_peak, same, chosen, gone):
        assert hint_lines(caplog, hint, steps=3) == []


def test_a_session_describes_what_the_probe_reads():
    """runtime.session.placement_figures gives every key reserve_probe and the profiler's advice read."""
    from runtime import offload
    from runtime.bundled.example_model import ExampleLM, ModelShape
    from runtime.session import placement_figures

    model, optimizer = offload(ExampleLM(ModelShape(vocab_size=256, hidden_size=32, num_layers=2, num_heads=2,
                                                    ffn_size=64, max_seq_len=16)), {"dtype": "fp32"})
    with optimizer.session as session:
        figures = placement_figures(session)
    assert set(figures) == set(CONFIG)
    assert figures["gpu_update_fraction_auto"] and figures["activation_reserve_auto"] and figures["keep_auto"]


def _peak_hints(config: dict, kind: type = PeakHint) -> int:
    from runtime import offload
    from runtime.bundled.example_model import ExampleLM, ModelShape

    shape = ModelShape(vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, max_seq_len=16)
    _, optimizer = offload(ExampleLM(shape), config)
    with optimizer.session as session:
        return sum(isinstance(listener, kind) for listener in session.controller.step_listeners)


def test_on_the_cpu_offload_listens_for_no_gpu_peak():
    assert _peak_hints({"dtype": "fp32"}) == 0


@pytest.mark.gpu
def test_on_a_gpu_offload_listens_for_the_peak_only_with_auto_placement():
    """On CUDA with the update fraction and the reserve auto, offload() measures the first step and places after it
    (runtime.planning.measured_placement) rather than hinting for the next run, gradients summed in host memory included;
    where that path is not taken (a compute-dtype copy of the weights may pay under accumulation, and the first
    step's plan spills nothing) the hint is installed. A hand-set fraction or reserve gets neither."""
    from runtime.planning.measured_placement import FirstStepPlacement

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA; run on the GPU machine")
    assert _peak_hints({"dtype": "bf16"}, FirstStepPlacement) == 1 and _peak_hints({"dtype": "bf16"}) == 0
    summed = {"dtype": "fp32", "optimizer": {"accumulation_steps": 2, "accumulate_on": "host"}}
    assert _peak_hints(summed, FirstStepPlacement) == 1 and _peak_hints(summed) == 0
    copy_may_pay = {"dtype": "bf16", "optimizer": {"accumulation_steps": 2}}
    assert _peak_hints(copy_may_pay) == 1 and _peak_hints(copy_may_pay, FirstStepPlacement) == 0
    for config in ({"dtype": "bf16", "optimizer": {"gpu_update_fraction": 0.5}},
                   {"dtype": "bf16", "tiers": {"gpu": {"activation_reserve": "1GiB"}}}):
        assert _peak_hints(config) == 0 and _peak_hints(config, FirstStepPlacement) == 0


def test_reserved_bytes_are_split_by_the_stream_they_were_cached_for(monkeypatch):
    """Segments of the current (compute) stream on the session's device on one side, every other stream's on the
    other; another device's segments count for neither."""
    import types

    import torch

    from runtime.planning.peak_hint import StreamPools, cuda_reserved_by_stream

    gib = 1 << 30
    segments = [{"device": 1, "stream": 7, "total_size": 4 * gib, "allocated_size": 3 * gib},
                {"device": 1, "stream": 9, "total_size": gib, "allocated_size": gib // 4},
                {"device": 1, "stream": 7, "total_size": 2 * gib, "allocated_size": 0},
                {"device": 0, "stream": 7, "total_size": 8 * gib, "allocated_size": 0}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=7))
    assert cuda_reserved_by_stream(torch.device("cuda", 1))() == StreamPools(6 * gib, 3 * gib, gib, 3 * gib // 4)


@pytest.mark.parametrize("settings, expected", [("expandable_segments:True", True), ("expandable_segments:False", False),
                                                ("max_split_size_mb:128,expandable_segments: true", True), ("", False)])
def test_a_measured_step_is_placed_from_its_allocated_peak_only_under_expandable_segments(monkeypatch, settings,
                                                                                         expected):
    """Which peak places a measured first step: under expandable segments the allocator's cache goes back wherever
    needed (the allocated peak), else the held one. The allocator's segments say which is in effect; before it holds
    any, the settings (the environment first, then what torch parsed last)."""
    from runtime.planning import peak_hint

    device = torch.device("cuda", 0)
    monkeypatch.setattr(peak_hint, "cuda_peak", lambda device: lambda: 1 << 30)
    monkeypatch.setattr(peak_hint, "cuda_reserved_peak", lambda device: lambda: 3 << 30)
    segments = [{"device": 0, "is_expandable": expected}, {"device": 1, "is_expandable": not expected}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:" + ("False" if expected else "True"))  # not asked
    assert peak_hint.expandable_segments(device) is expected
    peak, what = peak_hint.cuda_step_peak(device)
    assert peak() == (1 << 30 if expected else 3 << 30) and what().startswith("allocated") is expected
    segments.clear()  # nothing allocated yet: the settings say
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", settings)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")  # the older name: PYTORCH_ALLOC_CONF wins
    assert peak_hint.expandable_segments(device) is (expected if settings else False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: settings, raising=False)
    assert peak_hint.expandable_segments(device) is expected


def test_a_hint_after_one_step_says_step_not_steps(caplog):
    """A hint listening after one step said "the first 1 steps peaked" (issue 41)."""
    peaks = iter([1 * GIB, 12 * GIB])
    lines = hint_lines(caplog, PeakHint(CONFIG, BLOCKS, ask, lambda: next(peaks), after_steps=1), steps=2)
    assert len(lines) == 1 and "the first 1 step peaked at 12.00 GiB" in lines[0], lines
