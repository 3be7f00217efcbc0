"""runtime.planning.auto_placement: the `auto` placement knobs chosen from given rates and budgets, and their resolution
through the config and runtime.session (on the CPU: 0; on a GPU: with given rates, no CUDA needed to plan)."""

from __future__ import annotations

import dataclasses
import itertools
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.config.loader import ConfigError, dump_config, load_config
from runtime.core.blocks import build_blocks
from runtime.planning.auto_placement import (
    ACTIVATION_SHARE,
    Placement,
    PlacementInputs,
    Rates,
    StepTimes,
    activation_reserve_nbytes,
    blocks_within,
    choose_placement,
    gpu_streamed_blocks,
    gpu_updated_blocks,
    step_times,
)
from runtime.planning.memory_plan import make_plan

GiB = 1 << 30
HOMES = {"master": "host", "exp_avg": "host", "exp_avg_sq": "host", "weights": "host"}
# A Llama-shaped 1.35B model: embedding, 24 layers, final norm + head.
LLAMA = (65_536_000, *[50_600_000] * 24, 65_536_000)
REFERENCE = Rates(adam_params_per_s=3.6e9, h2d_bytes_per_s=55e9, d2h_bytes_per_s=55e9)
SHAPE = ModelShape(vocab_size=512, hidden_size=64, num_layers=6, num_heads=4, ffn_size=160)
AUTO = {"update": "auto", "stream": "auto", "keep": "auto"}


def inputs(numels=LLAMA, budget=16 * GiB, source="master", reason=None, homes=HOMES) -> PlacementInputs:
    """The chooser's inputs for bf16 weights fetched from ``source``, with the real plan's GPU bytes."""
    def gpu_plan_nbytes(updated: int, streamed: int) -> int:
        return make_plan(list(numels[updated:]), homes, source, 2, 2, 1, gpu_updated_numels=list(numels[:updated]),
                         streamed=streamed).gpu_nbytes

    return PlacementInputs(block_numels=tuple(numels), gpu_budget_nbytes=budget, gpu_plan_nbytes=gpu_plan_nbytes,
                           compute_itemsize=2, fetch_itemsize=4 if source == "master" else 2,
                           weights_resident=source == "resident", no_stream_reason=reason)


def counts(numels, placement: Placement) -> tuple[int, int]:
    """Device-updated and streamed blocks the controller selects for a placement's fractions."""
    blocks = fake_blocks(numels)
    updated = gpu_updated_blocks(blocks, placement.gpu_update_fraction)
    streamed = gpu_streamed_blocks(blocks, placement.gpu_update_fraction, placement.gpu_stream_fraction)
    assert updated == frozenset(range(len(updated))) and not updated & streamed
    return len(updated), len(streamed)


def fake_blocks(numels):
    @dataclasses.dataclass
    class FakeBlock:
        index: int
        numel: int

    return [FakeBlock(i, n) for i, n in enumerate(numels)]


# --- the pure chooser -------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10**9), min_size=1, max_size=40), st.floats(0.0, 1.0))
def test_blocks_within_counts_what_the_controller_selects(numels, fraction):
    assert blocks_within(numels, fraction) == len(gpu_updated_blocks(fake_blocks(numels), fraction))


def test_a_slower_cpu_streams_more_and_a_slower_link_less():
    fractions = [choose_placement(inputs(), dataclasses.replace(REFERENCE, adam_params_per_s=rate), **AUTO)
                 .gpu_stream_fraction for rate in (8e9, 3.6e9, 1.5e9, 0.5e9)]
    assert fractions == sorted(fractions) and fractions[0] < fractions[-1]
    slow_link = choose_placement(inputs(), Rates(3.6e9, 5e9, 5e9), **AUTO)
    assert slow_link.gpu_stream_fraction < choose_placement(inputs(), REFERENCE, **AUTO).gpu_stream_fraction


def test_the_stream_fraction_minimises_the_slowest_term_over_block_boundaries():
    chosen = choose_placement(inputs(), REFERENCE, **AUTO)
    updated, streamed = counts(LLAMA, chosen)
    kept = chosen.keep_for_backward_nbytes // 2

    def bound(j: int) -> float:
        return step_times(inputs(), REFERENCE, updated=updated, streamed=j, kept_numel=kept).bound_s

    # Against every other boundary with the same kept bytes (the kept bytes can only shrink as j grows).
    assert all(bound(streamed) <= bound(j) + 1e-12 for j in range(len(LLAMA) - updated + 1))
    assert 0 < streamed < len(LLAMA) - updated  # neither extreme on the reference machine


def test_a_tight_gpu_budget_gives_no_device_update_and_a_small_keep():
    base = inputs(budget=1 << 50).gpu_plan_nbytes(0, 0)
    tight = inputs(budget=base + 300 * 2**20)
    chosen = choose_placement(tight, REFERENCE, **AUTO)
    assert chosen.gpu_update_fraction == 0.0
    room = tight.gpu_budget_nbytes - activation_reserve_nbytes(tight) - tight.gpu_plan_nbytes(0, counts(LLAMA, chosen)[1])
    assert 0 <= chosen.keep_for_backward_nbytes <= room < 200 * 2**20
    assert choose_placement(inputs(budget=base // 2), REFERENCE, **AUTO).gpu_update_fraction == 0.0


def test_a_roomy_gpu_updates_everything_there():
    chosen = choose_placement(inputs(budget=70 * GiB), REFERENCE, **AUTO)
    assert (chosen.gpu_update_fraction, chosen.gpu_stream_fraction, chosen.keep_for_backward_nbytes) == (1.0, 0.0, 0)
    assert "every block is updated on the GPU" in chosen.notes[1]


@pytest.mark.parametrize("source", ["master", "weights", "resident"])
@pytest.mark.parametrize("budget_gib", [3, 4, 8, 16, 24, 32, 70])
def test_the_choice_leaves_the_activation_reserve_free(budget_gib, source):
    case = inputs(budget=budget_gib * GiB, source=source)
    chosen = choose_placement(case, REFERENCE, **AUTO)
    updated, streamed = counts(LLAMA, chosen)
    reserve = activation_reserve_nbytes(case)
    assert reserve == int(ACTIVATION_SHARE * (case.gpu_budget_nbytes - case.gpu_plan_nbytes(0, 0)))
    used = case.gpu_plan_nbytes(updated, streamed) + chosen.keep_for_backward_nbytes
    assert used + reserve <= case.gpu_budget_nbytes
    if updated == len(LLAMA):
        return
    worst = len(LLAMA) - updated
    if case.gpu_plan_nbytes(updated, worst) + reserve <= case.gpu_budget_nbytes:
        # Room was left for the streamed state to grow to any later boundary, and one more device-updated block
        # would not have fitted beside it.
        assert case.gpu_plan_nbytes(updated + 1, worst - 1) + reserve > case.gpu_budget_nbytes
    else:
        # A budget too tight to stream the largest blocks at all: the most device-updated blocks without them.
        assert case.gpu_plan_nbytes(0, len(LLAMA)) + reserve > case.gpu_budget_nbytes
        assert case.gpu_plan_nbytes(updated + 1, 0) + reserve > case.gpu_budget_nbytes


def test_nothing_streams_when_master_or_moments_are_on_nvme():
    reason = "master or moments on nvme: streaming needs them in pinned host memory"
    chosen = choose_placement(inputs(reason=reason, homes={**HOMES, "exp_avg": "nvme", "exp_avg_sq": "nvme"}),
                              dataclasses.replace(REFERENCE, adam_params_per_s=0.2e9), **AUTO)
    assert chosen.gpu_stream_fraction == 0.0 and reason in chosen.notes[1]


def test_resident_weights_keep_nothing_and_count_their_memory():
    resident = inputs(source="resident", budget=8 * GiB)
    chosen = choose_placement(resident, REFERENCE, **AUTO)
    fetched = choose_placement(inputs(source="master", budget=8 * GiB), REFERENCE, **AUTO)
    assert chosen.keep_for_backward_nbytes == 0
    assert chosen.gpu_update_fraction < fetched.gpu_update_fraction  # the resident weights took their room
    updated, streamed = counts(LLAMA, chosen)
    assert resident.gpu_plan_nbytes(updated, streamed) + activation_reserve_nbytes(resident) <= 8 * GiB


def test_explicit_values_are_kept_and_auto_ones_fit_around_them():
    assert choose_placement(inputs(), REFERENCE, update=0.25, stream=0.3, keep=4 * GiB) == Placement(0.25, 0.3, 4 * GiB)
    chosen = choose_placement(inputs(budget=24 * GiB), REFERENCE, update=0.25, stream="auto", keep=0)
    assert chosen.gpu_update_fraction == 0.25 and chosen.keep_for_backward_nbytes == 0
    updated, streamed = counts(LLAMA, chosen)
    assert updated == blocks_within(LLAMA, 0.25) and streamed > 0
    assert "set" in chosen.notes[0]
    chosen = choose_placement(inputs(), REFERENCE, update="auto", stream=0.2, keep="auto")
    assert chosen.gpu_stream_fraction == 0.2
    assert counts(LLAMA, chosen)[1] == blocks_within(LLAMA, chosen.gpu_update_fraction + 0.2) - counts(LLAMA, chosen)[0]


def test_the_choice_is_deterministic_and_says_why_in_two_lines():
    first = choose_placement(inputs(), REFERENCE, **AUTO)
    assert first == choose_placement(inputs(), REFERENCE, **AUTO)
    memory, timing = first.notes
    assert memory.startswith("auto placement: gpu_update_fraction ") and "activation reserve" in memory
    assert "keep_for_backward" in memory and "GPU budget 16.00 GiB" in memory
    assert timing.lstrip().startswith("gpu_stream_fraction ") and "CPU AdamW 3.60 G params/s" in timing
    assert all(term in timing for term in ("T_cpu", "T_h2d", "T_d2h", "PCIe H2D/D2H 55/55 GB/s"))


def test_on_the_cpu_every_auto_is_zero():
    chosen = choose_placement(inputs(), None, update="auto", stream=0.5, keep="auto")
    assert (chosen.gpu_update_fraction, chosen.gpu_stream_fraction, chosen.keep_for_backward_nbytes) == (0.0, 0.5, 0)
    assert "the device is the CPU" in chosen.notes[0] and "gpu_stream_fraction" not in chosen.notes[0]


def test_step_times_count_the_bytes_of_each_path():
    numels = (100, 200, 300, 400)
    rates = Rates(adam_params_per_s=10.0, h2d_bytes_per_s=1.0, d2h_bytes_per_s=2.0)
    times = step_times(inputs(numels), rates, updated=1, streamed=1, kept_numel=300)
    # CPU: blocks 2-3; H2D: 12 B streamed + 4 B twice for blocks 1-3 less the kept; D2H: 12 B streamed + fp32 grads.
    assert times.cpu_s == pytest.approx(700 / 10)
    assert times.h2d_s == pytest.approx(12 * 200 + 4 * (2 * 900 - 300))
    assert times.d2h_s == pytest.approx((12 * 200 + 4 * 700) / 2)
    resident = step_times(inputs(numels, source="resident"), rates, updated=1, streamed=1, kept_numel=0)
    assert resident.h2d_s == pytest.approx(12 * 200 + 4 * 700)  # refreshes of the CPU-updated blocks only
    narrow = step_times(dataclasses.replace(inputs(numels), grad_itemsize=2), rates, updated=1, streamed=1, kept_numel=300)
    assert narrow.d2h_s == pytest.approx((12 * 200 + 2 * 700) / 2)  # bf16 host gradients (host_grad_dtype)
    # Updates waiting for the commit (clipping): what shares the step's end with them, the streamed state each way,
    # the next forward's fetches (or the refreshes) and the gradients held until the commit; the backward's
    # fetches ran before it.
    deferred = dataclasses.replace(inputs(numels), updates_wait_for_commit=True)
    times = step_times(deferred, rates, updated=1, streamed=1, kept_numel=300)
    assert times.cpu_s == pytest.approx(700 / 10)
    assert times.h2d_s == pytest.approx(12 * 200 + 4 * 900) and times.d2h_s == pytest.approx((12 * 200 + 4 * 700) / 2)
    resident = dataclasses.replace(inputs(numels, source="resident"), updates_wait_for_commit=True)
    assert step_times(resident, rates, updated=1, streamed=1, kept_numel=0).h2d_s == pytest.approx(12 * 200 + 4 * 700)


# --- the config -------------------------------------------------------------------------------------------

def test_auto_is_the_default_and_accepted_for_the_three_keys(tmp_path):
    default = load_config({})
    assert (default.optimizer.gpu_update_fraction, default.optimizer.gpu_stream_fraction,
            default.prefetch.keep_for_backward) == ("auto", "auto", "auto")
    path = tmp_path / "tiers.yaml"
    path.write_text(textwrap.dedent("""\
        optimizer:
          gpu_update_fraction: auto
          gpu_stream_fraction: 0.9
        prefetch:
          keep_for_backward: auto
        """))
    cfg = load_config(path)
    assert (cfg.optimizer.gpu_update_fraction, cfg.optimizer.gpu_stream_fraction) == ("auto", 0.9)
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(dump_config(cfg))
    assert load_config(dumped) == cfg


@pytest.mark.parametrize("key,value,line", [
    ("optimizer.gpu_update_fraction", "automatic", 2),
    ("optimizer.gpu_stream_fraction", "Auto", 2),
    ("prefetch.keep_for_backward", "auto-ish", 2),
])
def test_a_bad_value_is_refused_naming_auto(tmp_path, key, value, line):
    section, name = key.split(".")
    path = tmp_path / "tiers.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.yaml_path == key and info.value.line == line and "`auto`" in str(info.value)


def test_explicit_fraction_rules_apply_to_explicit_values_only():
    with pytest.raises(ConfigError, match="add up to more than 1"):
        load_config({"optimizer": {"gpu_update_fraction": 0.6, "gpu_stream_fraction": 0.6}})
    with pytest.raises(ConfigError, match="streams master and moments"):
        load_config({"optimizer": {"gpu_stream_fraction": 0.2}, "placement": {"master": "nvme"},
                     "tiers": {"nvme": {"path": "tmp"}}})
    load_config({"optimizer": {"gpu_update_fraction": 0.6}})  # the auto stream fraction fits around it
    load_config({"placement": {"master": "nvme"}, "tiers": {"nvme": {"path": "tmp"}}})  # auto: 0 there


# --- resolution in runtime.planning.placement ------------------------------------------------------------------------------

def test_offload_on_the_cpu_resolves_auto_to_zero_and_says_so(caplog):
    from runtime import offload

    with caplog.at_level("INFO", logger="runtime.session"):
        _model, optimizer = offload(ExampleLM(SHAPE), {"dtype": "fp32"})
    try:
        options = optimizer.session.controller.options
        assert (options.gpu_update_fraction, options.gpu_stream_fraction, options.keep_for_backward_nbytes) == (0, 0, 0)
        assert "auto placement: the device is the CPU" in optimizer.session.plan.table()
        assert "the device is the CPU" in caplog.text
    finally:
        optimizer.session.close()


def test_an_explicit_config_plans_exactly_as_before():
    from runtime.planning.placement import resolve_plan

    cfg = load_config({"dtype": "fp32", "optimizer": {"gpu_update_fraction": 0.3, "gpu_stream_fraction": 0.4, "grad_clip": None},
                       "prefetch": {"keep_for_backward": "1MiB"}})
    blocks = build_blocks(ExampleLM(SHAPE), cfg.blocks.min_block_size)
    for device in (torch.device("cpu"), torch.device("cuda", 0)):  # no rates are measured: nothing is auto
        resolved = resolve_plan(blocks, cfg, device)
        assert resolved.placement == Placement(0.3, 0.4, 1 << 20)
        assert not resolved.plan.notes and "auto placement" not in resolved.plan.table()
    updated = gpu_updated_blocks(blocks, 0.3)
    numels = [b.numel for b in blocks]
    expected = make_plan([n for i, n in enumerate(numels) if i not in updated], HOMES, "master", 4, 2, 1,
                         gpu_updated_numels=[numels[i] for i in sorted(updated)],
                         streamed=len(gpu_streamed_blocks(blocks, 0.3, 0.4)))
    assert resolved.plan.rows == expected.rows


def test_on_a_gpu_the_plan_resolves_auto_with_given_rates():
    """The CUDA path of resolve_plan, planned without CUDA: an explicit GPU budget and given rates."""
    from runtime.planning.placement import resolve_plan

    blocks = build_blocks(ExampleLM(SHAPE), 1)
    total = sum(b.numel for b in blocks)
    # Room for part of the model's state; a reserve set, so that the choice is made now (not after a first step).
    cfg = load_config({"tiers": {"gpu": {"budget": 36 * total, "activation_reserve": 24 * total}}})
    # A step's updates take the CPU 10 ms, its copies 1 ms: the CPU is the one to relieve.
    slow_cpu = Rates(adam_params_per_s=total / 1e-2, h2d_bytes_per_s=total * 4 / 1e-3, d2h_bytes_per_s=total * 4 / 1e-3)
    resolved = resolve_plan(blocks, cfg, torch.device("cuda", 0), rates=slow_cpu)
    placement = resolved.placement
    assert 0 < placement.gpu_update_fraction < 1 and placement.gpu_update_fraction + placement.gpu_stream_fraction <= 1
    updated = gpu_updated_blocks(blocks, placement.gpu_update_fraction)
    assert len(updated) == blocks_within([b.numel for b in blocks], placement.gpu_update_fraction)
    assert resolved.plan.notes == placement.notes and resolved.plan.table().count("auto placement") == 1
    assert resolved.plan.gpu_nbytes + placement.keep_for_backward_nbytes <= 36 * total
    assert placement.gpu_stream_fraction > 0
    nvme = load_config({"tiers": {"gpu": {"budget": 24 * total, "activation_reserve": 16 * total}, "nvme": {"path": "tmp"}},
                        "placement": {"moments": "nvme"}})
    on_disk = resolve_plan(blocks, nvme, torch.device("cuda", 0), rates=slow_cpu).placement
    assert on_disk.gpu_stream_fraction == 0 and "moments on nvme" in on_disk.notes[1]


def test_on_a_gpu_auto_placement_with_an_auto_reserve_waits_for_the_first_step():
    """Update fraction and activation reserve auto on a GPU: the plan is the first step's (every update on the CPU,
    nothing streamed or kept), and says so, also where it sums gradients in host memory; a plan that keeps a bf16
    copy of the weights under accumulation keeps choosing now."""
    from runtime.planning.measured_placement import FIRST_STEP_NOTE, TRIAL_NOTE
    from runtime.planning.memory_plan import WeightSource
    from runtime.planning.placement import resolve_plan

    blocks = build_blocks(ExampleLM(SHAPE), 1)
    total = sum(b.numel for b in blocks)
    rates = Rates(adam_params_per_s=total / 1e-2, h2d_bytes_per_s=total * 4 / 1e-3, d2h_bytes_per_s=total * 4 / 1e-3)
    resolved = resolve_plan(blocks, load_config({"tiers": {"gpu": {"budget": 36 * total}}}), torch.device("cuda", 0),
                            rates=rates, recomputable=True)
    placement = resolved.placement
    assert resolved.measured_first_step
    assert (placement.gpu_update_fraction, placement.gpu_stream_fraction, placement.keep_for_backward_nbytes) == (0, 0, 0)
    assert placement.rates == rates and resolved.plan.notes[0] == FIRST_STEP_NOTE
    assert resolved.plan.notes[1] == TRIAL_NOTE  # placement.activations auto, the default
    kept = resolve_plan(blocks, load_config({"tiers": {"gpu": {"budget": 36 * total}}, "placement": {"activations": "keep"}}),
                        torch.device("cuda", 0), rates=rates, recomputable=True)
    assert TRIAL_NOTE not in kept.plan.notes
    # Layers that cannot be recomputed (runtime.model.recompute.recompute_refusal, which the caller asks) try nothing.
    fixed = resolve_plan(blocks, load_config({"tiers": {"gpu": {"budget": 36 * total}}}), torch.device("cuda", 0),
                         rates=rates, recomputable=False)
    assert fixed.measured_first_step and TRIAL_NOTE not in fixed.plan.notes
    summed = load_config({"dtype": "fp32", "tiers": {"gpu": {"budget": 36 * total}},
                          "optimizer": {"accumulation_steps": 4, "accumulate_on": "host"}})
    measured = resolve_plan(blocks, summed, torch.device("cuda", 0), rates=rates)  # host sums: measured too
    assert measured.measured_first_step and measured.placement.host_sums
    assert measured.placement.gpu_update_fraction == 0
    # A bf16 copy of the weights may pay under accumulation; the plan chosen now streams instead of keeping it, so the
    # first step is measured fetching the master (a first step keeping the copy would rule out streaming after it).
    copied = load_config({"dtype": "bf16", "tiers": {"gpu": {"budget": 36 * total}},
                          "optimizer": {"accumulation_steps": 4, "accumulate_on": "gpu"}})
    streamed = resolve_plan(blocks, copied, torch.device("cuda", 0), rates=rates)
    assert streamed.measured_first_step and streamed.source is WeightSource.MASTER
    # Where the plan chosen now keeps the copy (nothing to stream), it is chosen now, as the copy would be lost.
    kept = load_config({"dtype": "bf16", "tiers": {"gpu": {"budget": 36 * total}},
                        "optimizer": {"accumulation_steps": 4, "accumulate_on": "gpu", "gpu_stream_fraction": 0}})
    chosen_now = resolve_plan(blocks, kept, torch.device("cuda", 0), rates=rates)
    assert not chosen_now.measured_first_step and chosen_now.source is WeightSource.WEIGHTS
    assert chosen_now.placement.gpu_update_fraction > 0


def test_a_first_step_plan_that_spills_moments_is_measured_too(tmp_path):
    """bf16 under accumulation with host sums and a host budget that spills moments (the 8B scenario's shape of
    plan): the first step is measured (a spilling plan never takes the weights copy), its moments spilled."""
    from runtime.planning.block_plan import plan_for
    from runtime.planning.memory_plan import WeightSource
    from runtime.planning.placement import resolve_plan
    from runtime.planning.settings import resolve_homes

    blocks = build_blocks(ExampleLM(SHAPE), 1)
    total = sum(b.numel for b in blocks)
    rates = Rates(adam_params_per_s=total / 1e-2, h2d_bytes_per_s=total * 4 / 1e-3, d2h_bytes_per_s=total * 4 / 1e-3)
    config = {"dtype": "bf16", "placement": {"moments": "auto"},
              "tiers": {"gpu": {"budget": 36 * total}, "nvme": {"path": str(tmp_path)}},
              "optimizer": {"accumulation_steps": 4, "accumulate_on": "host"}}
    roomy = resolve_plan(blocks, load_config(config), torch.device("cuda", 0), rates=rates)
    # The first step updates every block on the CPU (nothing streamed) fetching the fp32 master: its pinned memory,
    # the most any placement needs, with the last block's moments on disk.
    cfg = load_config(config)
    homes, _ = resolve_homes(cfg)
    unspilled = plan_for(blocks, cfg, homes, WeightSource.MASTER,
                         placement=Placement(0.0, 0.0, 0, host_sums=True)).host_nbytes
    last_moments = 2 * 4 * blocks[-1].numel
    config["tiers"]["host"] = {"budget": unspilled - last_moments // 2}
    resolved = resolve_plan(blocks, load_config(config), torch.device("cuda", 0), rates=rates)
    assert resolved.spilled_blocks and resolved.source is WeightSource.MASTER
    assert resolved.measured_first_step and resolved.placement.gpu_update_fraction == 0
    assert resolved.plan.host_nbytes <= unspilled - last_moments // 2  # it fits, spilled
    # Where even the first step's plan, spilled, does not fit the budget, placing some blocks on the GPU now may:
    # that plan is chosen at offload, as before.
    config["tiers"]["host"] = {"budget": roomy.plan.host_nbytes // 4}
    tight = resolve_plan(blocks, load_config(config), torch.device("cuda", 0), rates=rates)
    assert not tight.measured_first_step


def test_a_first_step_is_measured_where_the_weights_copy_does_not_fit(tmp_path):
    """bf16 under accumulation, host sums, int8 moments, nothing streamed, and a host budget that holds the first
    step's plan but not a bf16 copy of the weights beside the rest (the 8B scenario at 64 GiB with int8 moments):
    the copy may pay but is not kept, so the first step is measured (its placement then comes from the measured
    peak) rather than placed now from the estimated activation reserve. With room for the copy it is kept, chosen
    now; and a first step that spills moments within the budget is measured even where the plan chosen now keeps it."""
    from runtime.planning.block_plan import plan_for
    from runtime.planning.memory_plan import WeightSource
    from runtime.planning.placement import copy_fetch_may_pay, resolve_plan
    from runtime.planning.settings import resolve_homes

    blocks = build_blocks(ExampleLM(SHAPE), 1)
    total = sum(b.numel for b in blocks)
    rates = Rates(adam_params_per_s=total / 1e-2, h2d_bytes_per_s=total * 4 / 1e-3, d2h_bytes_per_s=total * 4 / 1e-3)
    config = {"dtype": "bf16", "tiers": {"gpu": {"budget": 36 * total}},
              "optimizer": {"accumulation_steps": 4, "accumulate_on": "host", "moment_dtype": "int8",
                            "gpu_stream_fraction": 0}}
    cfg = load_config(config)
    assert copy_fetch_may_pay(cfg, torch.device("cuda", 0), WeightSource.MASTER)
    homes, _ = resolve_homes(cfg)
    first_step = plan_for(blocks, cfg, homes, WeightSource.MASTER, placement=Placement(0.0, 0.0, 0, host_sums=True))
    with_copy = plan_for(blocks, cfg, homes, WeightSource.WEIGHTS, placement=Placement(0.0, 0.0, 0, host_sums=True))
    assert with_copy.host_nbytes > first_step.host_nbytes  # the copy's pinned bytes

    def resolve(budget: int, **tiers: object):
        return resolve_plan(blocks, load_config({**config, "tiers": {**config["tiers"], **tiers,
                                                                     "host": {"budget": budget}}}),
                            torch.device("cuda", 0), rates=rates)

    tight = resolve(first_step.host_nbytes)  # the plan chosen now, blocks on the GPU, has no room for the copy either
    assert tight.measured_first_step and tight.source is WeightSource.MASTER
    assert tight.placement.gpu_update_fraction == 0 and not tight.spilled_blocks
    roomy = resolve(4 * with_copy.host_nbytes)
    assert not roomy.measured_first_step and roomy.source is WeightSource.WEIGHTS
    # fp32 moments that may spill: a first step that spills within the budget is measured, where the plan chosen now
    # (blocks on the GPU leave host room) would keep the copy.
    config["optimizer"]["moment_dtype"] = "fp32"
    config["placement"] = {"moments": "auto"}
    fp32 = plan_for(blocks, load_config(config), homes, WeightSource.MASTER,
                    placement=Placement(0.0, 0.0, 0, host_sums=True))
    spilling = resolve(fp32.host_nbytes * 9 // 10, nvme={"path": str(tmp_path)})
    assert spilling.measured_first_step and spilling.spilled_blocks and spilling.source is WeightSource.MASTER


def test_tierstore_plan_prints_the_choice(tmp_path, capsys):
    from runtime.cli.main import main as cli_main

    path = tmp_path / "tiers.yaml"
    path.write_text("device: cpu\ntrain:\n  model:\n    num_layers: 2\n")
    assert cli_main(["plan", "--config", str(path)]) == 0
    assert "auto placement: the device is the CPU: gpu_update_fraction, gpu_stream_fraction, keep_for_backward 0" \
        in capsys.readouterr().out


def test_prefix_sums_are_block_boundaries():
    """Every fraction the chooser returns ends on a block boundary of the forward order."""
    chosen = choose_placement(inputs(budget=12 * GiB), REFERENCE, **AUTO)
    ends = {0.0, *(end / sum(LLAMA) for end in itertools.accumulate(LLAMA))}
    assert chosen.gpu_update_fraction in ends
    assert any(abs(chosen.gpu_update_fraction + chosen.gpu_stream_fraction - end) < 1e-12 for end in ends)


def _copy_case(**optimizer) -> tuple[list, dict]:
    """The CUDA path of resolve_plan (planned without CUDA) for a bf16 model under accumulation, nothing streamed."""
    blocks = build_blocks(ExampleLM(SHAPE), 1)
    total = sum(b.numel for b in blocks)
    config = {"dtype": "bf16", "tiers": {"gpu": {"budget": 64 * total}},
              "optimizer": {"accumulation_steps": 16, "gpu_update_fraction": 0.25, "gpu_stream_fraction": 0,
                            "grad_clip": None, **optimizer}}
    return blocks, config


def test_under_accumulation_the_plan_fetches_a_compute_dtype_copy_when_it_costs_nothing_else():
    """Master in pinned memory, 16 micro-batches a step: a bf16 copy of the weights (2 bytes a parameter of pinned
    memory) halves every fetch. The plan takes it when the host budget holds it beside the rest, and says so."""
    from runtime.planning.memory_plan import WeightSource
    from runtime.planning.placement import resolve_plan

    blocks, config = _copy_case()
    cuda = torch.device("cuda", 0)
    resolved = resolve_plan(blocks, load_config(config), cuda, rates=REFERENCE)
    assert resolved.source is WeightSource.WEIGHTS
    rows = {kind: nbytes for kind, _, nbytes in resolved.plan.rows}
    host_updated = [b.numel for b in blocks if b.index not in gpu_updated_blocks(blocks, resolved.placement.gpu_update_fraction)]
    assert rows["weights (compute dtype)"] >= 2 * sum(host_updated) and "fetch staging (fp32)" not in rows
    assert "placement.weights: a bf16 copy in pinned memory" in resolved.plan.table()

    # One byte short of the plan with the copy (the plan without it fits): the master is fetched, and the note says why.
    config["tiers"]["host"] = {"budget": resolved.plan.host_nbytes - 1}
    tight = resolve_plan(blocks, load_config(config), cuda, rates=REFERENCE)
    assert tight.source is WeightSource.MASTER and "fetch staging (fp32)" in {kind for kind, _, _ in tight.plan.rows}
    assert tight.plan.host_nbytes < resolved.plan.host_nbytes
    assert "placement.weights: fetched from the fp32 master, not a bf16 copy in pinned memory: it would not fit" \
        in tight.plan.table()


def test_without_accumulation_or_on_the_cpu_the_master_is_fetched():
    """One micro-batch a step fetches each block once or twice: the copy's CPU cast and pinned bytes buy little.
    On the CPU nothing crosses PCIe. Neither plan considers the copy (no note)."""
    from runtime.planning.memory_plan import WeightSource
    from runtime.planning.placement import resolve_plan

    blocks, config = _copy_case(accumulation_steps=1)
    once = resolve_plan(blocks, load_config(config), torch.device("cuda", 0), rates=REFERENCE)
    blocks, config = _copy_case()
    on_cpu = resolve_plan(blocks, load_config(config), torch.device("cpu"))
    for resolved in (once, on_cpu):
        assert resolved.source is WeightSource.MASTER and "placement.weights" not in resolved.plan.table()


def test_the_copy_never_costs_streaming():
    """A slow CPU makes auto placement stream updates to the GPU; a streamed block's update refreshes no host copy,
    so with streaming chosen the plan keeps fetching the master."""
    from runtime.planning.memory_plan import WeightSource
    from runtime.planning.placement import resolve_plan

    blocks, config = _copy_case()
    for knob in ("gpu_update_fraction", "gpu_stream_fraction"):
        del config["optimizer"][knob]  # auto
    total = sum(b.numel for b in blocks)
    # a reserve set: placed now (with an auto reserve the first step is measured, fetching the master)
    config["tiers"]["gpu"].update(budget=36 * total, activation_reserve=24 * total)
    slow_cpu = Rates(adam_params_per_s=total / 1e-2, h2d_bytes_per_s=total * 4 / 1e-3, d2h_bytes_per_s=total * 4 / 1e-3)
    resolved = resolve_plan(blocks, load_config(config), torch.device("cuda", 0), rates=slow_cpu)
    assert resolved.placement.gpu_stream_fraction > 0
    assert resolved.source is WeightSource.MASTER and "a streamed update refreshes no host copy" in resolved.plan.table()


def test_streamed_state_takes_the_activations_room_when_updates_wait_for_the_commit():
    """A reserve that leaves room for the first blocks' state but not for streamed state beside it: updates that run
    as gradients land get no streaming; updates that wait for the commit stream in the room the backward freed
    (within the budget), and the chosen plan's bytes held at the peak stay within budget less reserve."""
    base = inputs(budget=16 * GiB)
    resident_only = base.gpu_plan_nbytes(2, 0)
    reserve = base.gpu_budget_nbytes - resident_only  # room for two blocks' state, none for streaming beside it
    asap = dataclasses.replace(base, activation_reserve_nbytes=reserve)
    waiting = dataclasses.replace(asap, updates_wait_for_commit=True)
    slow_cpu = Rates(adam_params_per_s=1e9, h2d_bytes_per_s=55e9, d2h_bytes_per_s=55e9)
    now = choose_placement(asap, slow_cpu, **AUTO)
    later = choose_placement(waiting, slow_cpu, **AUTO)
    assert counts(LLAMA, now)[1] == 0 and counts(LLAMA, later)[1] > 0
    updated, streamed = counts(LLAMA, later)
    assert base.gpu_plan_nbytes(updated, 0) <= base.gpu_budget_nbytes - reserve
    assert base.gpu_plan_nbytes(updated, streamed) <= base.gpu_budget_nbytes


def test_the_rate_beside_copies_falls_back_to_the_rate_alone_and_never_exceeds_it(monkeypatch, caplog):
    """A probe that cannot run (no room for its buffers) leaves auto placement the rate timed alone, with a warning
    that says so; a rate beside copies above the one alone (timing noise) is capped at it."""
    import logging

    import runtime.update.rates as probe
    from tierstore import HostMemoryError

    for refusal in (torch.OutOfMemoryError("CUDA out of memory"), HostMemoryError(1 << 29, "page-lock", "cudaHostRegister refused")):
        def refuse(*args, refusal=refusal, **kwargs):
            raise refusal

        monkeypatch.setattr(probe, "cpu_adam_seconds_beside_copies", refuse)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="runtime.update.rates"):
            assert probe._adam_rate_beside_copies(torch.device("cpu"), 2, True, alone=4e9) == 4e9
        assert "could not time CPU AdamW beside copies" in caplog.text and "4.00 G params/s" in caplog.text

    def broken(*args, **kwargs):  # anything else is a bug or a dead CUDA context: it surfaces
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(probe, "cpu_adam_seconds_beside_copies", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        probe._adam_rate_beside_copies(torch.device("cpu"), 2, True, alone=4e9)
    numel = probe.ADAM_PROBE_NUMEL
    monkeypatch.setattr(probe, "cpu_adam_seconds_beside_copies",
                        lambda *args, **kwargs: ([numel / 5e9, numel / 3e9, numel / 6e9], True))
    assert probe._adam_rate_beside_copies(torch.device("cpu"), 2, True, alone=4e9) == 4e9  # median 5e9, capped
    monkeypatch.setattr(probe, "cpu_adam_seconds_beside_copies",
                        lambda *args, **kwargs: ([numel / 3e9, numel / 2e9, numel / 2.5e9], True))
    assert probe._adam_rate_beside_copies(torch.device("cpu"), 2, True, alone=4e9) == pytest.approx(2.5e9)


def test_a_steps_modelled_time_follows_the_compute_or_overlaps_it():
    """StepTimes.step_s: terms that wait for the commit come after the forward and backward; otherwise they run
    beside them, and a step is the longer of the two (what the recompute trial compares)."""
    beside = StepTimes(0.25, 0.1, 0.05)
    after = StepTimes(0.25, 0.1, 0.05, after_backward=True)
    assert beside.step_s(0.3) == 0.3 and beside.step_s(0.2) == 0.25
    assert after.step_s(0.3) == pytest.approx(0.55)

