"""The plan with compact Adam moments (``optimizer.moment_dtype``): the byte count planning keeps agrees with the
moments module's layout, the plan counts each format's bytes as the store allocates them (host, NVMe, and the GPU
share of the update), more blocks' moments fit in RAM before any spills, and the disk and streamed traffic follow."""

from __future__ import annotations

import pytest
import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.config.loader import load_config
from runtime.core.blocks import build_blocks
from runtime.planning.memory_plan import IO_ALIGNMENT
from runtime.planning.moment_sizes import QUANT_BLOCK, stored_moment_nbytes
from runtime.planning.placement import resolve_plan
from runtime.planning.predict import disk_state_nbytes
from runtime.update.moments import MOMENT_DTYPES, moment_nbytes, moment_storage
from tierstore import TierName, align_up

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


@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
def test_device_updated_and_streamed_state_is_planned_in_the_compact_size(moment_dtype):
    """A GPU share of the update takes compact moments there: the plan's device rows count their stored bytes (and the
    update's fp32 scratch), and the store's device tier holds what the plan says at rest."""
    torch.manual_seed(0)
    config = {"dtype": "fp32", "optimizer": {"grad_clip": None, "moment_dtype": moment_dtype,
                                             "gpu_update_fraction": 0.4, "gpu_stream_fraction": 0.3}}
    model, optimizer = offload(ExampleLM(SHAPE), config)
    session = optimizer.session
    with session:
        plan, controller = session.plan, session.controller
        assert controller.gpu_updated and controller.gpu_streamed

        def state_nbytes(index: int) -> int:
            block = session.blocks[index]
            return 4 * block.numel + 2 * moment_nbytes(moment_dtype, [s.numel for s in block.slots])

        rows = {row: n for row, tier, n in plan.rows if tier == "gpu"}
        assert rows["device-updated master + moments"] == sum(state_nbytes(i) for i in controller.gpu_updated)
        in_flight = next(n for row, n in rows.items() if row.startswith("streamed update state ("))
        assert in_flight == min(len(controller.gpu_streamed), 3) * max(state_nbytes(i) for i in controller.gpu_streamed)
        assert rows["compact moment scratch (fp32)"] > 0
        for index in controller.gpu_updated:
            for kind in ("exp_avg", "exp_avg_sq"):
                record = session.store.record(session.blocks[index].key(kind))
                assert record.home is TierName.GPU and record.meta.nbytes == moment_nbytes(
                    moment_dtype, [s.numel for s in session.blocks[index].slots])
        held = sum(session.store.record(session.blocks[i].key(kind)).meta.nbytes for i in controller.gpu_updated
                   for kind in ("master", "exp_avg", "exp_avg_sq"))
        assert held == rows["device-updated master + moments"]  # what the device tier holds for them, to the byte


def test_streamed_traffic_counts_the_stored_state_bytes():
    from runtime.bench.train_bound import tierstore_placement
    from runtime.planning.predict import row_traffic

    numels = [4096, 4096, 4096]
    compact = [moment_nbytes("int8", [n]) for n in numels]
    common = {"block_numels": numels, "gpu_updated": [], "streamed": [0, 1], "weight_source": "master",
              "homes": {"master": "host", "exp_avg": "host", "exp_avg_sq": "host"}, "spilled": [], "keep_nbytes": 0,
              "compute_elem_nbytes": 2, "accumulation": 1, "cpu_threads": 1}
    fp32 = row_traffic(tierstore_placement(**common))
    int8 = row_traffic(tierstore_placement(**common, moment_nbytes=compact))
    saved = 2 * (2 * (4 * 4096 - compact[0]))  # two streamed blocks' two moments, narrower
    assert fp32.h2d_nbytes - int8.h2d_nbytes == saved and fp32.d2h_nbytes - int8.d2h_nbytes == saved
