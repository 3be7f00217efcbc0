"""runtime.peak_hint: after the first committed step, the reserve the measured GPU peak supports and what auto
placement chooses with it, logged once, only when that puts more blocks on the GPU."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from runtime.autoplace import Placement
from runtime.controller import StepEvent
from runtime.peak_hint import FirstStepHint, reserve_probe

GIB = 2**30
NUMELS = [525_336_576] + [218_112_000] * 32 + [525_336_576]  # Llama-3-8B: embedding, 32 layers, head
BLOCKS = [SimpleNamespace(index=i, numel=n) for i, n in enumerate(NUMELS)]
CONFIG = {"gpu_update_fraction_auto": True, "activation_reserve_nbytes": int(10.1 * GIB), "gpu_budget_nbytes": 24 * GIB,
          "gpu_plan_nbytes": int(10.5 * GIB), "keep_for_backward_nbytes": 3 * GIB, "keep_auto": True}


def embedding_on_gpu(reserve: int) -> Placement:
    return Placement(NUMELS[0] / sum(NUMELS) + 1e-9, 0.0, 3 * GIB)


def test_the_probe_asks_auto_placement_at_the_reserve_the_peak_supports():
    """Peak 12 GiB with 10.5 planned and 3 kept by auto: nothing beyond the plan, so the reserve is the 10% margin
    (2.4 GiB, up to 2.5). A hand-set keep counts as the activations' room; a hand-set fraction, no peak or no
    lower reserve: no probe."""
    asked = []

    def ask(reserve):
        asked.append(reserve)
        return embedding_on_gpu(reserve)

    probe = reserve_probe(CONFIG, 12 * GIB, BLOCKS, ask)
    assert asked == [int(2.5 * GIB)] and probe["reserve_nbytes"] == int(2.5 * GIB) and probe["beyond_plan_nbytes"] == 0
    assert (probe["updated"], probe["streamed"], probe["keep_for_backward_nbytes"]) == (1, 0, 3 * GIB)
    probe = reserve_probe({**CONFIG, "keep_auto": False}, 15 * GIB, BLOCKS, ask)  # 4.5 GiB beyond the plan
    assert probe["beyond_plan_nbytes"] == int(4.5 * GIB) and probe["reserve_nbytes"] == 7 * GIB
    assert reserve_probe({**CONFIG, "gpu_update_fraction_auto": False}, 12 * GIB, BLOCKS, ask) is None
    assert reserve_probe(CONFIG, None, BLOCKS, ask) is None
    assert reserve_probe(CONFIG, 22 * GIB, BLOCKS, ask) is None  # 8.5 beyond + 2.4: not below 10.1


def test_the_first_step_logs_the_reserve_once(caplog):
    peaks = iter([1 * GIB, 12 * GIB, 13 * GIB])
    hint = FirstStepHint(CONFIG, BLOCKS, 0, embedding_on_gpu, lambda: next(peaks))
    with caplog.at_level(logging.INFO, logger="runtime.peak_hint"):
        hint(StepEvent("begin", 0, 0.0, "train"))
        hint(StepEvent("commit", 1, 1.0))
        hint(StepEvent("commit", 2, 2.0))
    lines = [r.getMessage() for r in caplog.records if r.name == "runtime.peak_hint"]
    assert len(lines) == 1, lines
    assert "first step peaked at 12.00 GiB of the 24.00 GiB GPU budget" in lines[0]
    assert "tiers.gpu.activation_reserve: 2.50 GiB (auto placement reserved 10.10 GiB) would update 1 more" in lines[0]


def test_no_line_when_the_step_s_peak_is_unknown_or_nothing_more_fits(caplog):
    with caplog.at_level(logging.INFO, logger="runtime.peak_hint"):
        FirstStepHint(CONFIG, BLOCKS, 0, embedding_on_gpu, lambda: 12 * GIB)(StepEvent("commit", 1, 1.0))  # setup's
        FirstStepHint(CONFIG, BLOCKS, 1, embedding_on_gpu, iter([GIB, 12 * GIB]).__next__)(StepEvent("commit", 1, 1.0))
    assert not [r for r in caplog.records if r.name == "runtime.peak_hint"]
