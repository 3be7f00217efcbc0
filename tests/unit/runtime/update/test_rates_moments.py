"""The CPU AdamW rate auto placement plans with is the run's own update: ``cpu_adam_seconds`` times
``adamw_update_block`` over moments stored as the run's ``moment_dtype`` (int8 through the compiled kernel where the
run takes it), ``offload()`` and ``tierstore plan`` ask for that rate, and the placement is chosen from it (rates
stubbed: timing would be flaky)."""

from __future__ import annotations

import pytest
import torch

from runtime import session as session_module
from runtime.bundled.example_model import ExampleLM
from runtime.config.loader import load_config
from runtime.planning.auto_placement import Rates
from runtime.update import moment_kernel, rates
from runtime.update.moment_kernel import Int8Kernel
from tests.integration.test_parity import SHAPE


class RecordingKernel(Int8Kernel):
    """Stands in for the compiled kernel: records its calls, computes nothing."""

    def __init__(self) -> None:  # no build
        self.calls: list[tuple[str, ...]] = []

    def update(self, master, grad, exp_avg, exp_avg_sq, sizes, keep, steps, hypers, out) -> None:
        self.calls.append((str(exp_avg.dtype), str(len(sizes))))


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16", "int8"])
def test_the_probe_times_the_update_of_the_runs_moments(monkeypatch, moment_dtype):
    seen = []
    real = rates.adamw_update_block

    def recording(master, grad, exp_avg, exp_avg_sq, sizes, keep, steps, hypers, dtype, **kwargs):
        seen.append((dtype, exp_avg.dtype, exp_avg.numel(), kwargs["scratch"].int8_kernel))
        real(master, grad, exp_avg, exp_avg_sq, sizes, keep, steps, hypers, dtype, **kwargs)

    monkeypatch.setattr(rates, "adamw_update_block", recording)
    times = rates.cpu_adam_seconds(1 << 14, 1, tensors=2, repeats=2, moment_dtype=moment_dtype)
    assert len(times) == 2 and all(t > 0 for t in times)
    stored = {"fp32": (torch.float32, 1 << 14), "bf16": (torch.bfloat16, 1 << 14), "int8": (torch.uint8, None)}[moment_dtype]
    assert [s[0] for s in seen] == [moment_dtype] * 3 and all(s[1] == stored[0] for s in seen)
    if stored[1] is not None:
        assert seen[0][2] == stored[1]
    else:  # codes, padding and scales: int8's stored buffer, a quarter of fp32's bytes and a little more
        assert (1 << 14) <= seen[0][2] < (1 << 14) * 1.1
    assert all(s[3] is None for s in seen)


def test_the_probe_runs_the_int8_kernel_it_is_given():
    kernel = RecordingKernel()
    rates.cpu_adam_seconds(1 << 14, 1, tensors=2, repeats=3, moment_dtype="int8", int8_kernel=kernel)
    assert kernel.calls == [("torch.uint8", "2")] * 4  # the warm-up and three timed steps, all through the kernel


def test_machine_rates_asks_for_the_runs_update(monkeypatch):
    asked = []
    kernel = RecordingKernel()
    monkeypatch.setattr(session_module, "measure_rates", lambda device, **kw: asked.append(kw) or "rates")
    monkeypatch.setattr(moment_kernel, "_built_once", lambda: (kernel, ""))
    cuda = torch.device("cuda", 0)
    for moment_dtype, choice, expected in (("fp32", "auto", None), ("int8", "torch", None), ("int8", "auto", kernel),
                                           ("bf16", "auto", kernel), ("bf16", "torch", None)):  # (compiled with fp32:
        # refused at load)
        cfg = load_config({"optimizer": {"moment_dtype": moment_dtype, "moment_kernel": choice, "cpu_threads": 3}})
        assert session_module.machine_rates(cfg, cuda) == "rates"
        assert asked[-1]["moment_dtype"] == moment_dtype and asked[-1]["int8_kernel"] is expected
        assert asked[-1]["cpu_threads"] == 3


def test_auto_placement_plans_with_the_compact_updates_rate(monkeypatch):
    """plan_model on a GPU (planned without CUDA: an explicit budget) takes the rate measured for its moment_dtype;
    a slower int8 update (torch ops) leaves the CPU more to relieve than fp32's rate would: more goes to the GPU."""
    from runtime.core.blocks import build_blocks

    model = ExampleLM(SHAPE)
    total = sum(b.numel for b in build_blocks(model, 1))
    copies = {"h2d_bytes_per_s": total * 4 / 1e-3, "d2h_bytes_per_s": total * 4 / 1e-3}
    # Per format: fp32 relieves the CPU little (its updates take about the copies' time), int8 in torch ops much.
    by_dtype = {"fp32": Rates(adam_params_per_s=total / 2e-3, **copies), "int8": Rates(adam_params_per_s=total / 2e-2, **copies)}
    monkeypatch.setattr(session_module, "measure_rates", lambda device, **kw: by_dtype[kw["moment_dtype"]])
    placements = {}
    for moment_dtype in ("fp32", "int8"):
        cfg = load_config({"blocks": {"min_block_size": 1}, "tiers": {"gpu": {"budget": 36 * total, "activation_reserve": 24 * total}},
                           "optimizer": {"moment_dtype": moment_dtype, "moment_kernel": "torch"}})
        _blocks, resolved, _budgets = session_module.plan_model(model, cfg, torch.device("cuda", 0))
        placements[moment_dtype] = resolved.placement
        assert resolved.placement.rates == by_dtype[moment_dtype]
    fp32, int8 = placements["fp32"], placements["int8"]
    assert int8.gpu_update_fraction + int8.gpu_stream_fraction > fp32.gpu_update_fraction + fp32.gpu_stream_fraction
