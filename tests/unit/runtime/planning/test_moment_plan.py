"""The plan with compact Adam moments (``optimizer.moment_dtype``): the byte count planning keeps agrees with the
moments module's layout, the plan counts each format's bytes as the store allocates them, more blocks' moments fit
in RAM before any spills, the disk traffic follows, and the GPU update keys are resolved or refused."""

from __future__ import annotations

import pytest
import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.config.loader import ConfigError, load_config
from runtime.core.blocks import build_blocks
from runtime.planning.memory_plan import IO_ALIGNMENT
from runtime.planning.moment_sizes import QUANT_BLOCK, stored_moment_nbytes
from runtime.planning.placement import measures_first_step, rates_needed, resolve_plan
from runtime.planning.predict import disk_state_nbytes
from runtime.planning.settings import cpu_updates_only
from runtime.update.device_updates import refuse_compact_on_device
from runtime.update.moments import MOMENT_DTYPES, moment_nbytes, moment_storage
from tierstore import align_up

SHAPE = ModelShape(vocab_size=512, hidden_size=64, num_layers=6, num_heads=4, ffn_size=160)
SIZES = [[1], [7], [QUANT_BLOCK], [QUANT_BLOCK + 1], [64, 4096, 3 * QUANT_BLOCK - 5], [100_000, 17, 2048 * 11]]


@pytest.mark.parametrize("moment_dtype", MOMENT_DTYPES)
def test_planning_counts_the_bytes_the_moments_module_stores(moment_dtype):
    """planning may not import runtime.update: its byte count is its own, and must be the layout's to the byte (the
    host arena is sized from it)."""
    for sizes in SIZES:
        dtype, numel = moment_storage(moment_dtype, sizes)
        assert stored_moment_nbytes(moment_dtype, sizes) == moment_nbytes(moment_dtype, sizes) == numel * dtype.itemsize


def _moment_row(plan, kind: str) -> int:
    return sum(n for row, tier, n in plan.rows if row.startswith(f"{kind} (") and tier in ("host", "nvme"))


@pytest.mark.parametrize("moments", ["host", "nvme"])
@pytest.mark.parametrize("grad_clip", [None, 1.0], ids=["streaming", "pre-commit-buffers"])
def test_plan_counts_each_formats_moment_bytes_as_the_store_allocates_them(moments, grad_clip, tmpfs_dir):
    rows = {}
    for moment_dtype in MOMENT_DTYPES:
        torch.manual_seed(0)
        config = {"dtype": "fp32", "placement": {"moments": moments},
                  "optimizer": {"grad_clip": grad_clip, "moment_dtype": moment_dtype},
                  "tiers": {"nvme": {"path": str(tmpfs_dir)}}}
        _, optimizer = offload(ExampleLM(SHAPE), config)
        session = optimizer.session
        with session:
            plan = session.plan
            blocks = session.blocks
            expected = sum(align_up(moment_nbytes(moment_dtype, [s.numel for s in b.slots]), IO_ALIGNMENT) for b in blocks)
            if moments == "nvme":
                expected += len(blocks) * IO_ALIGNMENT  # each swap file's header
            for kind in ("exp_avg", "exp_avg_sq"):
                assert _moment_row(plan, kind) == expected
                assert any(moment_dtype in row for row, _, _ in plan.rows if row.startswith(kind))
                assert all(session.store.record(b.key(kind)).meta.nbytes == moment_nbytes(
                    moment_dtype, [s.numel for s in b.slots]) for b in blocks)
            assert plan.pre_commit_buffers == (grad_clip is not None and moments == "host")
            usage = session.store.usage()
            assert usage["host"]["capacity_nbytes"] == plan.host_nbytes  # the arena sized from the plan, to the byte
            if moments == "nvme":
                assert usage["nvme"]["used_nbytes"] == pytest.approx(plan.nvme_nbytes, rel=0.02)
            rows[moment_dtype] = _moment_row(plan, "exp_avg")
    assert rows["bf16"] < 0.55 * rows["fp32"]
    assert rows["int8"] < rows["bf16"]


def test_compact_moments_keep_more_blocks_moments_in_ram(tmpfs_dir):
    """placement.moments: auto under a host budget where fp32 moments spill: int8 moments all stay in pinned memory,
    bf16 spill fewer blocks than fp32."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = ExampleLM(ModelShape(vocab_size=512, hidden_size=256, num_layers=8, num_heads=4, ffn_size=688))
    blocks = build_blocks(model, 1 << 16)

    def resolved(moment_dtype: str, budget: int):
        cfg = load_config({"dtype": "fp32", "device": "cpu", "placement": {"moments": "auto"},
                           "tiers": {"nvme": {"path": str(tmpfs_dir)}, "host": {"budget": budget}},
                           "optimizer": {"grad_clip": None, "moment_dtype": moment_dtype}})
        return resolve_plan(blocks, cfg, torch.device("cpu"))

    unspilled = {dtype: resolved(dtype, 1 << 40).plan.host_nbytes for dtype in MOMENT_DTYPES}
    budget = (unspilled["fp32"] + unspilled["bf16"]) // 2
    spilled = {dtype: len(resolved(dtype, budget).spilled_blocks) for dtype in MOMENT_DTYPES}
    assert spilled["fp32"] > spilled["bf16"] >= spilled["int8"] == 0
    assert unspilled["int8"] < unspilled["bf16"] < unspilled["fp32"]


def test_disk_traffic_counts_the_stored_moment_bytes():
    numels = [1000, 2000, 3000]
    homes = {"master": "host", "exp_avg": "host", "exp_avg_sq": "host"}
    fp32 = disk_state_nbytes(numels, set(), homes, {1, 2})
    assert fp32 == 2 * 4 * (2000 + 3000)
    compact = [moment_nbytes("int8", [n]) for n in numels]
    assert disk_state_nbytes(numels, set(), homes, {1, 2}, compact) == 2 * (compact[1] + compact[2])
    on_nvme = {"master": "nvme", "exp_avg": "nvme", "exp_avg_sq": "nvme"}
    assert disk_state_nbytes(numels, {0}, on_nvme, set(), compact) == 4 * 5000 + 2 * (compact[1] + compact[2])


@pytest.mark.parametrize("key", ["gpu_update_fraction", "gpu_stream_fraction"])
@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
def test_gpu_update_keys_above_zero_are_refused_with_compact_moments(key, moment_dtype):
    with pytest.raises(ConfigError) as info:
        load_config({"optimizer": {"moment_dtype": moment_dtype, key: 0.25}})
    message = str(info.value)
    assert f"optimizer.{key}" in message and "moment_dtype" in message and "on the CPU" in message
    load_config({"optimizer": {"moment_dtype": moment_dtype, key: 0.0}})  # 0 is what they resolve to anyway
    load_config({"optimizer": {"moment_dtype": "fp32", key: 0.25}})


@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
def test_auto_gpu_update_keys_resolve_to_zero_with_compact_moments(moment_dtype):
    cuda = torch.device("cuda", 0)  # only compared, never used
    compact = load_config({"optimizer": {"moment_dtype": moment_dtype}})
    assert cpu_updates_only(compact).optimizer.gpu_update_fraction == 0.0
    assert cpu_updates_only(compact).optimizer.gpu_stream_fraction == 0.0
    assert not measures_first_step(compact, cuda)
    default = load_config({})
    assert cpu_updates_only(default) is default and measures_first_step(default, cuda) and rates_needed(default, cuda)
    with pytest.raises(ValueError, match="update on the CPU"):  # a placement made by other means is refused too
        refuse_compact_on_device(moment_dtype, 0.0, 0.5)
    refuse_compact_on_device("fp32", 0.5, 0.5)
