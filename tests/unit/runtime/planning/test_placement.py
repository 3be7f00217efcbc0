"""runtime.planning.placement: planning is given the machine's rates (it times nothing), and asked again for a running
session it keeps what that session has fixed (``InForce``)."""

from __future__ import annotations

import pytest
import torch

from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.config.loader import load_config
from runtime.config.units import approx_size
from runtime.core.blocks import build_blocks
from runtime.planning.auto_placement import Rates
from runtime.planning.memory_plan import WeightSource
from runtime.planning.placement import InForce, placement_at_reserve, rates_needed, resolve_plan

SHAPE = ModelShape(vocab_size=512, hidden_size=64, num_layers=6, num_heads=4, ffn_size=160)
CUDA = torch.device("cuda", 0)  # planned for, not used: nothing here allocates on it


def _blocks():
    return build_blocks(ExampleLM(SHAPE), 1)


def _rates(blocks) -> Rates:
    total = sum(b.numel for b in blocks)
    return Rates(adam_params_per_s=total / 1e-2, h2d_bytes_per_s=total * 4 / 1e-3, d2h_bytes_per_s=total * 4 / 1e-3)


def test_rates_are_needed_only_for_an_auto_knob_on_a_gpu():
    explicit = {"optimizer": {"gpu_update_fraction": 0.5, "gpu_stream_fraction": 0.0}, "prefetch": {"keep_for_backward": 0}}
    assert rates_needed(load_config({}), CUDA)
    assert not rates_needed(load_config({}), torch.device("cpu"))
    assert not rates_needed(load_config(explicit), CUDA)
    keep_auto = {**explicit, "prefetch": {"keep_for_backward": "auto"}}
    assert rates_needed(load_config(keep_auto), CUDA)


def test_auto_placement_on_a_gpu_without_rates_is_refused_not_planned_as_on_the_cpu():
    """Planning never measures: without rates an auto knob on a GPU would silently resolve to 0 as on the CPU."""
    blocks = _blocks()
    cfg = load_config({"tiers": {"gpu": {"budget": 36 * sum(b.numel for b in blocks)}}})
    with pytest.raises(ValueError, match="rates"):
        resolve_plan(blocks, cfg, CUDA)
    assert resolve_plan(blocks, cfg, CUDA, rates=_rates(blocks)).measured_first_step
    assert resolve_plan(blocks, cfg, torch.device("cpu")).placement.gpu_update_fraction == 0  # no rates on the CPU


@pytest.mark.parametrize(("spills", "streams", "source", "reason"), [
    (True, True, WeightSource.MASTER, "moments spill to NVMe"),
    (False, False, WeightSource.MASTER, "this session streams nothing"),
    (False, False, WeightSource.WEIGHTS, "compute-dtype copy of the weights"),
    (False, True, WeightSource.MASTER, None),
])
def test_asked_again_a_session_keeps_what_it_fixed(spills, streams, source, reason):
    """A session that spills moments or streams nothing is not offered streaming at another reserve; the GPU budget
    is the store's, the rates the ones it was placed with."""
    blocks = _blocks()
    total = sum(b.numel for b in blocks)
    cfg = load_config({"dtype": "fp32", "tiers": {"gpu": {"budget": 1 << 40}}})  # the store's budget wins
    in_force = InForce(gpu_budget_nbytes=36 * total, source=source, spills=spills, streams=streams, rates=_rates(blocks))
    placement = placement_at_reserve(blocks, cfg, CUDA, in_force, 12 * total)
    assert placement.rates == in_force.rates and placement.activation_reserve_nbytes == 12 * total
    assert f"GPU budget {approx_size(36 * total)}" in placement.notes[0]
    if reason is None:
        assert placement.gpu_stream_fraction >= 0
    else:
        assert placement.gpu_stream_fraction == 0 and reason in placement.notes[1], placement.notes
