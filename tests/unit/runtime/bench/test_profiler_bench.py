"""The profiler-overhead bench: the same session timed with the profiler off and on, on a train-bench row's config."""

from __future__ import annotations

import functools

import pytest

import runtime.profiler as profiler_package
from runtime.bench.profiler_bench import HEADLINE_ROW, bench_config, format_result, measure_profiler_overhead
from runtime.bench.train_rows import row_config


def test_headline_config_is_the_train_bench_row():
    config = bench_config(HEADLINE_ROW)
    assert config == {**row_config(HEADLINE_ROW, None), "optimizer": {**row_config(HEADLINE_ROW, None)["optimizer"],
                                                                     "accumulation_steps": 1}}
    assert config["placement"] == {"weights": "host", "master": "host", "moments": "host", "activations": "keep"}
    assert config["optimizer"]["gpu_stream_fraction"] == pytest.approx(0.4)
    assert config["prefetch"]["keep_for_backward"] == "4GiB"
    assert bench_config("host-accum8")["optimizer"]["accumulation_steps"] == 8
    for row in ("torch", "ds-zero3-cpu", "nvme-auto", "host-cap"):
        with pytest.raises(ValueError, match="tierstore row"):
            bench_config(row)
    with pytest.raises(ValueError, match="unknown row"):
        bench_config("hots-s40")


def test_overhead_is_measured_on_both_sides_with_ceilings_of_the_same_run(monkeypatch):
    real = profiler_package.measure_ceilings
    monkeypatch.setattr(profiler_package, "measure_ceilings", functools.partial(real, nbytes=1 << 20, repeats=1))
    result = measure_profiler_overhead("tiny", steps=2, rounds=2, batch_size=2, seq_len=32, row=HEADLINE_ROW)
    assert result["timed_steps"] == [4, 4]
    assert result["off_step_s"] > 0 and result["on_step_s"] > 0
    assert result["ratio"] == pytest.approx(result["on_step_s"] / result["off_step_s"])
    assert result["events_per_step"] > 0 and set(result["ceilings_gbps"]) == {"h2d", "d2h"}
    paths = result["summary"]["totals"]["paths"]
    assert paths["h2d"]["nbytes"] > 0 and paths["h2d"]["ceiling_gbps"] == result["ceilings_gbps"]["h2d"]
    text = format_result(result)
    assert "overhead ratio" in text and HEADLINE_ROW in text and "traffic per path" in text
