"""The memory plan's table calls the device what it is (issue 41): on a CPU-only machine its "gpu" tier is the CPU's
memory outside the host arena, so no row says gpu or GPU; a GPU run's table is as it was."""

from __future__ import annotations

import re

import torch

from runtime.config.loader import load_config
from runtime.planning.hostmem import HostMemory
from runtime.planning.memory_plan import check_fits, make_plan

HOMES = {"master": "host", "exp_avg": "host", "exp_avg_sq": "host", "weights": "host"}
RAM = HostMemory(total_nbytes=64 << 30, available_nbytes=64 << 30, limit="a test machine")


def _plan():
    # Two GPU-updated blocks and host sums: the rows whose labels speak of the GPU.
    return make_plan([1 << 20] * 4, HOMES, "master", 2, 2, 4, gpu_updated_numels=[1 << 20] * 2, host_sums=True,
                     grad_itemsize=2)


def test_a_cpu_plan_has_no_gpu_rows():
    plan = _plan()
    check_fits(plan, load_config(None), torch.device("cpu"), memory=RAM)
    table = plan.table()
    tiers = {line.split()[-3] for line in table.splitlines()[3:]}  # the column before "<size> <unit>"
    assert "gpu" not in tiers and "device" in tiers, table
    assert "GPU" not in table and "the device is the CPU" in table, table
    assert plan.gpu_nbytes > 0  # the bytes are the same; only their name changed


def test_a_gpu_plan_table_is_unchanged():
    plan = _plan()  # as check_fits leaves it on a CUDA device (the default)
    table = plan.table()
    assert re.search(r"^  total +gpu +56\.0 MiB$", table, re.MULTILINE) and "(GPU-updated)" in table, table
    assert "device" not in table.replace("device-updated", "")
