"""The out-of-memory hint of auto placement: the figure it suggests and the setting it names."""

from __future__ import annotations

import torch

from runtime.bundled.example_model import ExampleLM
from runtime.planning.oom_hint import GiB, install_oom_hint, reserve_hint
from tests.integration.test_parity import SHAPE


def test_hint_names_the_setting_and_a_reserve_above_what_the_step_reached():
    line = reserve_hint(requested_nbytes=1 * GiB, allocated_nbytes=30 * GiB, store_gpu_nbytes=8 * GiB,
                        reserve_nbytes=20 * GiB, placed_nbytes=6 * GiB)
    # The step reached 30 + 1 GiB, 8 of them the store's: 23 GiB beside it, 10% headroom -> 26 GiB (rounded up).
    assert "tiers.gpu.activation_reserve: 26GiB" in line
    assert "23.00 GiB beside tierstore's memory" in line
    assert "reserved 20.00 GiB for activations" in line
    assert "placement.activations" not in line
    recomputed = reserve_hint(requested_nbytes=1 * GiB, allocated_nbytes=30 * GiB, store_gpu_nbytes=8 * GiB,
                              reserve_nbytes=20 * GiB, placed_nbytes=6 * GiB, recomputed=True)
    # a reserve set by hand ends the measured steps that chose recomputation: the line names both settings
    assert "activation_reserve: 26GiB with placement.activations: recompute" in recomputed


def test_hint_never_suggests_a_negative_reserve():
    line = reserve_hint(requested_nbytes=0, allocated_nbytes=1 * GiB, store_gpu_nbytes=2 * GiB, reserve_nbytes=0,
                        placed_nbytes=0)
    assert "activation_reserve: 0GiB" in line


def test_observer_is_silent_once_its_owner_is_gone(monkeypatch):
    observers = []
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", observers.append, raising=False)
    lines = []

    class Owner:
        pass

    owner = Owner()
    owner.name = "session"
    assert install_oom_hint(owner, lambda held, requested, allocated: f"{held.name} {requested} {allocated}")
    monkeypatch.setattr("runtime.planning.oom_hint.log.error", lambda fmt, line: lines.append(line))
    observers[0](0, 5, 7, 0)
    del owner
    observers[0](0, 5, 7, 0)
    assert lines == ["session 5 7"]


def test_activation_reserve_set_in_the_config_reaches_auto_placement():
    from runtime.config.loader import load_config
    from runtime.core.blocks import build_blocks
    from runtime.planning.auto_placement import Rates
    from runtime.planning.placement import resolve_placement
    from runtime.planning.settings import resolve_homes

    model = ExampleLM(SHAPE)
    blocks = build_blocks(model, 1, None)
    rates = Rates(adam_params_per_s=3e9, h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9)
    chosen = {}
    for reserve in ("auto", "1GiB", "1TiB"):
        cfg = load_config({"tiers": {"gpu": {"budget": "2GiB", "activation_reserve": reserve}}})
        homes, source = resolve_homes(cfg)
        chosen[reserve] = resolve_placement(blocks, cfg, torch.device("cuda"), homes, source, rates=rates)
    assert chosen["1GiB"].activation_reserve_nbytes == GiB
    assert "activation reserve 1.00 GiB (set)" in chosen["1GiB"].notes[0]
    assert chosen["1TiB"].gpu_update_fraction == 0.0  # a reserve over the budget leaves no room for state
    assert chosen["auto"].activation_reserve_nbytes < 2 * GiB
