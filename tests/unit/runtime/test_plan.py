"""The memory plan matches what the store really allocates, tier by tier, and a plan that cannot fit is refused."""

from __future__ import annotations

import pytest
import torch

from runtime import offload
from runtime.example_model import ExampleLM, ModelShape
from runtime.hostmem import HostMemory
from runtime.plan import PlanError, check_plan, make_plan

SHAPE = ModelShape(vocab_size=512, hidden_size=64, num_layers=6, num_heads=4, ffn_size=160)


def ram(available: int, total: int | None = None, limit: str = "a test machine") -> HostMemory:
    """Host RAM as check_plan sees it: ``available`` now of ``total`` (default: as much again)."""
    return HostMemory(total_nbytes=total or available, available_nbytes=available, limit=limit)


def _rest_nbytes(plan, tier: str) -> int:
    """Planned bytes on a tier that are held at rest (staging rooms are transient)."""
    return sum(n for kind, t, n in plan.rows if t == tier and "staging" not in kind and "in flight" not in kind
               and "assembly" not in kind)


@pytest.mark.parametrize("placement,fraction", [
    ({"weights": "host", "master": "host", "moments": "host"}, 0.0),
    ({"weights": "host", "master": "host", "moments": "nvme"}, 0.0),
    ({"weights": "host", "master": "nvme", "moments": "nvme"}, 0.0),
    ({"weights": "gpu", "master": "host", "moments": "host"}, 0.0),
    ({"weights": "host", "master": "host", "moments": "nvme"}, 0.5),
])
def test_plan_matches_the_store_accounting(placement, fraction, tmpfs_dir):
    torch.manual_seed(0)
    config = {"dtype": "fp32", "placement": placement, "optimizer": {"gpu_update_fraction": fraction, "grad_clip": None},
              "tiers": {"nvme": {"path": str(tmpfs_dir)}}}
    model, optimizer = offload(ExampleLM(SHAPE), config)
    session = optimizer.session
    plan = session.plan
    try:
        tokens = torch.randint(0, SHAPE.vocab_size, (2, 17))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
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
    from runtime.plan import spill_moments

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
    from runtime.config import ConfigError, load_config

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
    from runtime.api import resolve_plan
    from runtime.blocks import build_blocks
    from runtime.config import load_config
    from runtime.controller import gpu_streamed_blocks

    cfg = load_config({"dtype": "fp32", "device": "cpu", "placement": {"moments": "auto"},
                       "optimizer": {"gpu_stream_fraction": 0.4},
                       "tiers": {"nvme": {"path": str(tmp_path)}, "host": {"budget": 4096}}})
    blocks = build_blocks(ExampleLM(SHAPE), cfg.blocks.min_block_size)
    streamed = gpu_streamed_blocks(blocks, 0.0, 0.4)
    resolved = resolve_plan(blocks, cfg, torch.device("cpu"))
    assert streamed and not streamed & resolved.spilled_blocks
    assert resolved.spilled_blocks | streamed == frozenset(b.index for b in blocks)
