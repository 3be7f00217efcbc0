"""The memory plan matches what the store really allocates, tier by tier, and a plan that cannot fit is refused."""

from __future__ import annotations

import pytest
import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.planning.hostmem import HostMemory
from runtime.planning.memory_plan import PlanError, check_plan, make_plan

SHAPE = ModelShape(vocab_size=512, hidden_size=64, num_layers=6, num_heads=4, ffn_size=160)


def ram(available: int, total: int | None = None, limit: str = "a test machine") -> HostMemory:
    """Host RAM as check_plan sees it: ``available`` now of ``total`` (default: as much again)."""
    return HostMemory(total_nbytes=total or available, available_nbytes=available, limit=limit)


def _rest_nbytes(plan, tier: str) -> int:
    """Planned bytes on a tier that are held at rest (staging rooms are transient)."""
    return sum(n for kind, t, n in plan.rows if t == tier and "staging" not in kind and "in flight" not in kind
               and "assembly" not in kind)


@pytest.mark.parametrize("placement,fraction,host_sums,dtype", [
    ({"weights": "host", "master": "host", "moments": "host"}, 0.0, False, "fp32"),
    ({"weights": "host", "master": "host", "moments": "nvme"}, 0.0, False, "fp32"),
    ({"weights": "host", "master": "nvme", "moments": "nvme"}, 0.0, False, "fp32"),
    ({"weights": "gpu", "master": "host", "moments": "host"}, 0.0, False, "fp32"),
    ({"weights": "host", "master": "host", "moments": "nvme"}, 0.5, False, "fp32"),
    # optimizer.accumulate_on: host pins the sum buffers beside the gradients, no model-sized device gradient
    ({"weights": "host", "master": "host", "moments": "host"}, 0.0, True, "fp32"),
    # under bf16 the host gradients and sum buffers are bf16 (optimizer.host_grad_dtype: auto)
    ({"weights": "host", "master": "host", "moments": "host"}, 0.0, True, "bf16"),
])
def test_plan_matches_the_store_accounting(placement, fraction, host_sums, dtype, tmpfs_dir):
    torch.manual_seed(0)
    micro_batches = 2 if host_sums else 1
    config = {"dtype": dtype, "placement": placement, "optimizer": {
                  "gpu_update_fraction": fraction, "grad_clip": None, "accumulation_steps": micro_batches,
                  "accumulate_on": "host" if host_sums else "gpu"},
              "tiers": {"nvme": {"path": str(tmpfs_dir)}}}
    model, optimizer = offload(ExampleLM(SHAPE), config)
    session = optimizer.session
    plan = session.plan
    assert (session.controller.sums is not None) == host_sums
    assert not any(kind == "accumulated gradients" for kind, _, _ in plan.rows)
    hosted = session.controller.host_updated_blocks
    grad_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    assert all(session.store.record(b.key("grad")).meta.dtype == grad_dtype for b in hosted)
    grads = next(n for kind, _, n in plan.rows if kind.startswith("gradients ("))
    unpadded = sum(b.numel for b in hosted) * grad_dtype.itemsize
    assert unpadded <= grads < unpadded + len(hosted) * 4096  # each buffer padded to the IO alignment
    try:
        for _ in range(micro_batches):
            tokens = torch.randint(0, SHAPE.vocab_size, (2, 17))
            model(tokens[:, :-1], tokens[:, 1:]).float().backward()
        optimizer.step()
        optimizer.synchronize()
        usage = session.store.usage()
        # The pinned arena is exactly the plan's host total (it is sized from it, to the byte).
        assert usage["host"]["capacity_nbytes"] == plan.host_nbytes
        # At rest, what the store holds on host and NVMe is what the plan says, within 2%.
        assert usage["host"]["used_nbytes"] == pytest.approx(_rest_nbytes(plan, "host"), rel=0.02)
        on_nvme = "nvme" in (placement["master"], placement["moments"])
        assert (plan.nvme_nbytes > 0) == on_nvme
        assert usage["nvme"]["used_nbytes"] == pytest.approx(plan.nvme_nbytes, rel=0.02)
        # On the device, the tier accounts resident weights and device-updated state: planned at rest too.
        assert usage["gpu"]["used_nbytes"] == pytest.approx(_rest_nbytes(plan, "gpu"), rel=0.02)
    finally:
        session.close()


def test_plan_that_does_not_fit_is_refused_with_numbers_and_a_suggestion():
    plan = make_plan([10**9] * 4, {"master": "host", "exp_avg": "host", "exp_avg_sq": "host", "weights": "host"},
                     "master", 2, 2, 1)
    with pytest.raises(PlanError) as info:
        check_plan(plan, host_budget_nbytes=None, gpu_budget_nbytes=1 << 40, nvme_path=None, nvme_budget_nbytes=0,
                   memory=ram(8 << 30))
    message = str(info.value)
    assert "host" in message and "GiB" in message
    assert "placement." in message and "nvme" in message  # says what to change


def test_gpu_budget_refusal():
    plan = make_plan([10**8] * 4, {"master": "host", "exp_avg": "host", "exp_avg_sq": "host", "weights": "host"},
                     "resident", 2, 2, 1)
    with pytest.raises(PlanError, match="gpu"):
        check_plan(plan, host_budget_nbytes=None, gpu_budget_nbytes=1 << 20, nvme_path=None, nvme_budget_nbytes=0,
                   memory=ram(1 << 50))


def test_spill_moments_keeps_on_host_what_fits_and_spills_the_last_blocks():
    from runtime.planning.memory_plan import spill_moments

    homes = {"master": "host", "exp_avg": "host", "exp_avg_sq": "host", "weights": "host"}
    numels = [10**6] * 20

    def make(spilled: int):
        return make_plan(numels, homes, "master", 2, 2, 1, spilled=spilled)

    everything = make(0).host_nbytes
    assert spill_moments(make, len(numels), everything) == 0  # it all fits: nothing goes to disk
    k = spill_moments(make, len(numels), everything - 10 * 4 * 10**6)  # ten fp32 moment blocks short
    plan = make(k)
    assert plan.host_nbytes <= everything - 10 * 4 * 10**6 and 0 < k < len(numels)
    assert make(k - 1).host_nbytes > everything - 10 * 4 * 10**6  # the fewest blocks that fit
    assert plan.homes["exp_avg"] == "host+nvme" and plan.nvme_nbytes > 0
    assert spill_moments(make, len(numels), 1) == len(numels)  # nothing fits: all spill (check_plan then refuses)


@pytest.mark.parametrize("overrides,field", [
    ({"optimizer": {"gpu_update_fraction": 0.7, "gpu_stream_fraction": 0.5}}, "gpu_stream_fraction"),
    ({"optimizer": {"gpu_stream_fraction": 0.5}, "placement": {"moments": "nvme"}, "tiers": {"nvme": {"path": "tmp"}}},
     "placement"),
])
def test_streamed_update_refuses_contradicting_settings(overrides, field):
    from runtime.config.loader import ConfigError, load_config

    with pytest.raises(ConfigError, match=field):
        load_config(overrides)


def test_streamed_blocks_have_no_host_gradient_in_the_plan():
    homes = {"master": "host", "exp_avg": "host", "exp_avg_sq": "host", "weights": "host"}
    plain = make_plan([10**6] * 10, homes, "master", 2, 2, 1)
    streamed = make_plan([10**6] * 10, homes, "master", 2, 2, 1, streamed=4)
    grads = {k: n for k, t, n in streamed.rows if k.startswith("gradients")}
    assert list(grads.values()) == [6 * (4 * 10**6 + (-4 * 10**6) % 4096)]
    assert streamed.gpu_nbytes - plain.gpu_nbytes == 3 * 12 * 10**6  # the next block, one updated, one written back


def test_streamed_blocks_never_spill_their_moments(tmp_path):
    """placement.moments: auto with a budget nothing fits: every block spills except the streamed ones,
    whose moments the GPU copies from pinned memory each step."""
    from runtime.config.loader import load_config
    from runtime.core.blocks import build_blocks
    from runtime.planning.auto_placement import gpu_streamed_blocks
    from runtime.planning.placement import resolve_plan

    cfg = load_config({"dtype": "fp32", "device": "cpu", "placement": {"moments": "auto"},
                       "optimizer": {"gpu_stream_fraction": 0.4},
                       "tiers": {"nvme": {"path": str(tmp_path)}, "host": {"budget": 4096}}})
    blocks = build_blocks(ExampleLM(SHAPE), cfg.blocks.min_block_size)
    streamed = gpu_streamed_blocks(blocks, 0.0, 0.4)
    resolved = resolve_plan(blocks, cfg, torch.device("cpu"))
    assert streamed and not streamed & resolved.spilled_blocks
    assert resolved.spilled_blocks | streamed == frozenset(b.index for b in blocks)


HOMES_ON_HOST = {"master": "host", "exp_avg": "host", "exp_avg_sq": "host", "weights": "host"}
HOMES_ON_NVME = {"master": "host", "exp_avg": "nvme", "exp_avg_sq": "nvme", "weights": "host"}


def small_plan(homes=HOMES_ON_HOST):
    return make_plan([10**6] * 4, homes, "master", 4, 2, 1)


def refusal(plan, **kwargs) -> str:
    args = {"host_budget_nbytes": None, "gpu_budget_nbytes": 1 << 40, "nvme_path": None, "nvme_budget_nbytes": 1 << 40,
            "memory": ram(64 << 30)}
    with pytest.raises(PlanError) as info:
        check_plan(plan, **{**args, **kwargs})
    return str(info.value)


def test_an_explicit_host_budget_below_the_plan_is_refused_with_both_numbers():
    plan = small_plan()
    message = refusal(plan, host_budget_nbytes=1 << 20)
    assert "tiers.host.budget is 1.0 MiB (1,048,576 bytes)" in message and f"{plan.host_nbytes:,}" in message


def test_an_explicit_host_budget_over_the_ram_this_process_may_use_is_refused():
    message = refusal(small_plan(), host_budget_nbytes=64 << 40,
                      memory=ram(30 << 30, 64 << 30, "cgroup v2 limit 64.00 GiB (memory.max of /sys/fs/cgroup/job)"))
    assert "tiers.host.budget 64.00 TiB is more RAM than this process may use" in message
    # usable = 30 GiB available - 6.4 GiB headroom (10% of the 64 GiB limit, not of the host's RAM)
    assert "23.60 GiB usable" in message and "memory.max of /sys/fs/cgroup/job" in message


def test_the_plan_is_checked_against_available_ram_less_headroom():
    plan = small_plan()
    fits = ram(plan.host_nbytes + (2 << 30))  # exactly the plan plus the 2 GiB minimum headroom
    check_plan(plan, host_budget_nbytes=None, gpu_budget_nbytes=1 << 40, nvme_path=None, nvme_budget_nbytes=0, memory=fits)
    message = refusal(plan, memory=ram(plan.host_nbytes + (2 << 30) - 4096))
    assert "host: the plan pins" in message and "placement." in message


def test_swap_files_on_tmpfs_count_as_ram(tmpfs_dir, disk_dir):
    from runtime.planning.hostmem import ram_backed

    if ram_backed(tmpfs_dir) is None or ram_backed(disk_dir) is not None:
        pytest.skip("needs a tmpfs and a disk directory")
    plan = small_plan(HOMES_ON_NVME)
    memory = ram(plan.host_nbytes + (2 << 30) + plan.nvme_nbytes // 2)  # the arena fits, arena + swap does not
    check_plan(plan, host_budget_nbytes=None, gpu_budget_nbytes=1 << 40, nvme_path=str(disk_dir), nvme_budget_nbytes=1 << 40,
               memory=memory)
    message = refusal(plan, nvme_path=str(tmpfs_dir), memory=memory)
    assert f"plus the swap files on {tmpfs_dir} (tmpfs: RAM)" in message and "tiers.nvme.path on a disk" in message


def test_the_gpu_and_nvme_budgets_are_refused_together_with_the_host():
    plan = small_plan(HOMES_ON_NVME)
    message = refusal(plan, host_budget_nbytes=4096, gpu_budget_nbytes=1 << 20, nvme_path="/nonexistent-dir",
                      nvme_budget_nbytes=1 << 20)
    lines = [line.split(":")[0].strip() for line in message.splitlines()[1:5]]
    assert lines == ["host", "gpu", "nvme", "nvme"]  # budget, then free space on a missing directory (0)


def test_updates_waiting_for_the_commit_get_second_buffers_when_the_host_has_room():
    from runtime.config.loader import load_config
    from runtime.session import plan_model

    def plan(**optimizer):
        cfg = load_config({"dtype": "fp32", "optimizer": optimizer})
        return plan_model(ExampleLM(SHAPE), cfg, torch.device("cpu"))[1].plan

    rows = lambda p: {kind: n for kind, _, n in p.rows}  # noqa: E731
    clipped, streaming = plan(grad_clip=1.0), plan(grad_clip=None)
    assert "pre-commit update buffers" not in rows(streaming)
    spares = rows(clipped)["pre-commit update buffers"]
    assert spares == sum(rows(clipped)[f"{kind} (fp32)"] for kind in ("master", "exp_avg", "exp_avg_sq"))
    assert clipped.host_nbytes == streaming.host_nbytes + spares
    assert "pre-commit update buffers" in rows(plan(grad_clip=None, user_grad_clip=True))


def test_pre_commit_buffers_are_given_up_before_any_moment_spills(tmp_path):
    from runtime.config.loader import load_config
    from runtime.core.blocks import build_blocks
    from runtime.planning.placement import resolve_plan
    from runtime.planning.settings import resolve_device

    base = {"dtype": "fp32", "tiers": {"nvme": {"path": str(tmp_path)}}, "placement": {"moments": "auto"},
            "optimizer": {"grad_clip": 1.0}}
    cfg = load_config(base)
    blocks = build_blocks(ExampleLM(SHAPE), cfg.blocks.min_block_size)
    roomy = resolve_plan(blocks, cfg, resolve_device(cfg)).plan
    assert any(kind == "pre-commit update buffers" for kind, _, _ in roomy.rows)
    base["tiers"]["host"] = {"budget": roomy.host_nbytes - 4096}
    tight = resolve_plan(blocks, load_config(base), resolve_device(cfg))
    assert not tight.spilled_blocks
    assert not any(kind == "pre-commit update buffers" for kind, _, _ in tight.plan.rows)


def test_a_plan_without_pre_commit_buffers_gets_none_at_run_time(tmp_path):
    # The budget spills moments, so the plan gives the second buffers up; the store must not allocate them
    # anyway out of the room the plan keeps for staging the spilled moments.
    from runtime.config.loader import load_config
    from runtime.core.blocks import build_blocks
    from runtime.planning.placement import resolve_plan
    from runtime.planning.settings import resolve_device

    config = {"dtype": "fp32", "tiers": {"nvme": {"path": str(tmp_path)}}, "placement": {"moments": "auto"},
              "optimizer": {"grad_clip": 1e6}}
    cfg = load_config(config)
    roomy = resolve_plan(build_blocks(ExampleLM(SHAPE), cfg.blocks.min_block_size), cfg, resolve_device(cfg)).plan
    spares = sum(n for kind, _, n in roomy.rows if kind == "pre-commit update buffers")
    config["tiers"]["host"] = {"budget": roomy.host_nbytes - spares - 4096}
    torch.manual_seed(0)
    model, optimizer = offload(ExampleLM(SHAPE), config)
    session = optimizer.session
    try:
        assert session.controller.options.spilled_blocks
        assert not any(kind == "pre-commit update buffers" for kind, _, _ in session.plan.rows)
        tokens = torch.randint(0, SHAPE.vocab_size, (2, 17))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.synchronize()
        assert session.store.usage()["host"]["used_nbytes"] == pytest.approx(_rest_nbytes(session.plan, "host"), rel=0.02)
    finally:
        session.close()


def test_host_sums_leave_device_updated_blocks_summing_on_the_device():
    homes = {"master": "host", "exp_avg": "host", "exp_avg_sq": "host", "weights": "host"}
    on_gpu = make_plan([10**6] * 10, homes, "master", 2, 2, 4)
    on_host = make_plan([10**6] * 8, homes, "master", 2, 2, 4, gpu_updated_numels=[10**6] * 2, streamed=3,
                        host_sums=True)
    rows = {kind: (tier, nbytes) for kind, tier, nbytes in on_host.rows}
    assert dict((k, n) for k, _, n in on_gpu.rows)["accumulated gradients"] == 10 * 10**6 * 2
    assert rows["accumulated gradients (GPU-updated)"] == ("gpu", 5 * 10**6 * 2)  # 2 updated + 3 streamed
    assert rows["gradient sum buffers (4)"][0] == "host"


@pytest.mark.parametrize("budget_grads,accumulate_on,steps,expected", [
    (3, "auto", 4, True),  # the gradients are a third of the GPU budget: summed on the host
    (5, "auto", 4, False),  # a fifth: they stay on the device
    (3, "gpu", 4, False), (100, "host", 4, True), (3, "auto", 1, False),  # nothing to sum without accumulation
])
def test_accumulate_on_resolves_from_the_gpu_budget(budget_grads, accumulate_on, steps, expected):
    from runtime.config.loader import load_config
    from runtime.core.blocks import build_blocks
    from runtime.planning.settings import sums_on_host

    blocks = build_blocks(ExampleLM(SHAPE), 1)
    grads_nbytes = 2 * sum(block.numel for block in blocks)  # bf16
    cfg = load_config({"dtype": "bf16", "tiers": {"gpu": {"budget": budget_grads * grads_nbytes}},
                       "optimizer": {"accumulation_steps": steps, "accumulate_on": accumulate_on}})
    assert sums_on_host(blocks, cfg, torch.device("cpu")) is expected


def test_oversized_blocks_spill_their_moments_last():
    """An embedding-sized block spilled would make every staging room its size: it spills after the layers."""
    from runtime.planning.memory_plan import spill_order

    numels = [50, 10, 10, 10, 10, 50]  # embedding, four layers, head
    assert spill_order(numels) == [4, 3, 2, 1, 5, 0]
    assert spill_order(numels, streamed=2) == [4, 3, 2, 5]  # streamed blocks never spill
    homes = {"master": "host", "exp_avg": "host", "exp_avg_sq": "host", "weights": "host"}
    plan = make_plan([n * 1024 for n in numels], homes, "master", 2, 2, 1, spilled=3)
    rows = {kind: nbytes for kind, _, nbytes in plan.rows}
    assert rows["exp_avg staging"] == 3 * 10 * 1024 * 4  # rooms of a layer's size, not the head's


def test_weights_in_flight_are_the_largest_blocks_the_window_can_hold():
    """The weights on the GPU are the window's blocks, whichever they are (a tied head held through the backward,
    a checkpoint segment of several blocks): the plan counts the largest that many, not the largest block once
    per slot (a 128k vocabulary's head charged to every slot of the 8B plan: 5.2 GiB it can never hold)."""
    from runtime.planning.memory_plan import window_bound

    numels = [50, 10, 10, 10, 10, 50]  # embedding, four layers, head
    assert window_bound(numels, 4) == 120 and window_bound(numels, 1) == 50
    assert window_bound(numels, 9) == 140 and window_bound(numels, 0) == 0 and window_bound([], 3) == 0
    homes = {"master": "host", "exp_avg": "host", "exp_avg_sq": "host", "weights": "host"}
    plan = make_plan([n * 1024 for n in numels], homes, "master", 2, 2, 1)  # depth 2: four blocks in flight
    rows = {kind: nbytes for kind, _, nbytes in plan.rows}
    assert rows["weights (4 blocks in flight)"] == 120 * 1024 * 2
    # The fp32 master crosses one piece at a time ([Note: fetch staging]): the largest block's, not the window's.
    assert rows["fetch staging (fp32)"] == 50 * 1024 * 4
    # A block updated on the GPU is not fetched: the window is the others' (the head and three layers).
    plan = make_plan([n * 1024 for n in numels[1:]], homes, "master", 2, 2, 1, gpu_updated_numels=[50 * 1024])
    rows = {kind: nbytes for kind, _, nbytes in plan.rows}
    assert rows["weights (4 blocks in flight)"] == 80 * 1024 * 2


def test_fetch_staging_is_one_piece_of_a_block_larger_than_a_piece():
    """A block larger than a fetch piece stages that piece only: 256 MiB of fp32, not the 2.1 GB of a 128k
    vocabulary's head (the 8B plan had counted the whole window, 4.39 GiB)."""
    from runtime.planning.buffers import FETCH_PIECE_NUMEL

    homes = {"master": "host", "exp_avg": "host", "exp_avg_sq": "host", "weights": "host"}
    plan = make_plan([3 * FETCH_PIECE_NUMEL, FETCH_PIECE_NUMEL // 4], homes, "master", 2, 2, 1)
    rows = {kind: nbytes for kind, _, nbytes in plan.rows}
    assert rows["fetch staging (fp32)"] == FETCH_PIECE_NUMEL * 4


def test_an_auto_gpu_budget_stays_under_the_process_s_memory_cap(monkeypatch):
    """A process capped with torch.cuda.set_per_process_memory_fraction (24 GiB of an 80 GiB card, 2 GiB already
    held) plans with 90% of what the cap leaves, not of the card's free memory."""
    import runtime.planning.memory_plan as plan_module
    from runtime.config.loader import load_config
    from runtime.planning.memory_plan import gpu_budget_nbytes

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * gib)
    monkeypatch.setattr(plan_module, "allocator_limit_nbytes", lambda device: 24 * gib)
    cfg = load_config({})
    assert gpu_budget_nbytes(cfg, torch.device("cuda")) == int(0.9 * 22 * gib)
    monkeypatch.setattr(plan_module, "allocator_limit_nbytes", lambda device: 80 * gib)  # uncapped: the card's free
    assert gpu_budget_nbytes(cfg, torch.device("cuda")) == int(0.9 * 70 * gib)


def test_the_advice_for_a_plan_over_the_host_budget_names_keys_the_config_has():
    """It said `placement.exp_avg_sq: nvme` (a state kind, not a config key: the config refused it)."""
    from runtime.config.loader import load_config
    from runtime.planning.memory_plan import _host_hint

    class Homes:
        homes = {"master": "host", "exp_avg": "host", "exp_avg_sq": "host", "weights": "gpu"}

    hint = _host_hint(Homes, None)  # type: ignore[arg-type]
    assert "placement.master: nvme" in hint and "placement.moments: nvme" in hint and "exp_avg" not in hint
    load_config({"placement": {"master": "nvme", "moments": "nvme"}, "tiers": {"nvme": {"path": "tmp"}}})


def test_the_plan_table_keeps_a_long_label_apart_from_its_tier():
    """A 32-character label ran into its tier ('streamed update state (2 blocks)gpu'; found by a helper)."""
    from runtime.planning.memory_plan import MemoryPlan

    long = "gradient assembly: host sum (compute dtype)"
    plan = MemoryPlan(num_params=1, homes={}, weight_source="master",
                      rows=[("streamed update state (2 blocks)", "gpu", 1 << 20), (long, "gpu", 1 << 20)])
    lines = plan.table().splitlines()
    assert any(line.strip().startswith("streamed update state (2 blocks) ") for line in lines)
    assert any(line.strip().startswith(long + " ") and line.split()[-3] == "gpu" for line in lines)
