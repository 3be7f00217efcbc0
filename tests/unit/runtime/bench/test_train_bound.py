"""The bench's per-row bound: row-to-bytes accounting as arithmetic, and against what a real session moves."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.bench.deepspeed_rows import deepspeed_placement
from runtime.bench.train_bound import STATE_NBYTES, Rates, RowPlacement, plain_placement, row_bound, row_traffic, tierstore_placement

N = 1000


def placement(**overrides):
    """A tierstore placement of 10 blocks of 100 parameters, weights fetched from the fp32 master."""
    args = {"block_numels": [100] * 10, "gpu_updated": [], "streamed": [], "weight_source": "master",
            "homes": {"master": "host", "exp_avg": "host", "exp_avg_sq": "host"}, "spilled": [], "keep_nbytes": 0,
            "compute_elem_nbytes": 2, "accumulation": 1, "cpu_threads": 4}
    args.update(overrides)
    return tierstore_placement(**args)


def test_host_row_fetches_every_weight_twice_but_the_last_block():
    t = row_traffic(placement())
    # fp32 master fetched for forward (10 blocks) and backward (9: the last block is still there), fp32 grads out.
    assert t.h2d_nbytes == 4 * (2 * N - 100)
    assert t.d2h_nbytes == 4 * N
    assert (t.cpu_update_numel, t.gpu_update_numel, t.disk_read_nbytes) == (N, 0, 0)


def test_keep_counts_kept_blocks_once_within_the_budget():
    # 350 bytes hold one block of bf16 weights (200 bytes): the last one, which backward reuses anyway.
    assert row_traffic(placement(keep_nbytes=350)).h2d_nbytes == 4 * (2 * N - 100)
    # 600 bytes: the last three blocks stay.
    assert row_traffic(placement(keep_nbytes=600)).h2d_nbytes == 4 * (2 * N - 300)
    # Everything fits: each weight fetched once.
    assert row_traffic(placement(keep_nbytes=1 << 30)).h2d_nbytes == 4 * N


def test_a_block_larger_than_the_keep_budget_is_skipped_not_a_stop():
    numels = [100] * 9 + [1000]  # the last block (2000 bf16 bytes) never fits 600 bytes; the three before it do
    p = placement(block_numels=numels, keep_nbytes=600)
    assert p.kept_numel == 1000 + 300


def test_gpu_update_and_stream_shares():
    p = placement(gpu_updated=[0, 1], streamed=[2, 3, 4])
    t = row_traffic(p)
    assert (t.gpu_update_numel, t.cpu_update_numel, p.streamed_numel) == (500, 500, 300)
    # Weights: blocks 2..9 fetched (800); backward again except the last (700); streamed blocks skip the first
    # forward (their GPU update leaves them there). State of the streamed blocks in and out.
    assert t.h2d_nbytes == 4 * (800 + 700 - 300) + STATE_NBYTES * 300
    assert t.d2h_nbytes == 4 * 500 + STATE_NBYTES * 300


def test_accumulation_fetches_per_micro_batch_and_sends_gradients_once():
    t = row_traffic(placement(accumulation=8, streamed=[0]))
    assert t.compute_passes == 8
    assert t.h2d_nbytes == 4 * (8 * (2 * N - 100) - 100) + STATE_NBYTES * 100
    assert t.d2h_nbytes == 4 * 900 + STATE_NBYTES * 100


def test_resident_weights_fetch_nothing_and_are_refreshed_after_the_cpu_update():
    t = row_traffic(placement(weight_source="resident", gpu_updated=[0], keep_nbytes=1 << 30))
    assert t.h2d_nbytes == 4 * 900  # the fp32 master of every CPU-updated block, cast on the GPU
    assert t.d2h_nbytes == 4 * 900


def test_bf16_weight_copy_and_nvme_state():
    p = placement(weight_source="weights", homes={"master": "nvme", "exp_avg": "nvme", "exp_avg_sq": "nvme"},
                  gpu_updated=[0])
    t = row_traffic(p)
    assert t.h2d_nbytes == 2 * (900 + 800)
    assert t.disk_read_nbytes == t.disk_write_nbytes == STATE_NBYTES * 900


def test_spilled_blocks_put_only_their_moments_on_disk():
    p = placement(homes={"master": "host", "exp_avg": "host", "exp_avg_sq": "host"}, spilled=[8, 9])
    assert row_traffic(p).disk_read_nbytes == 2 * 4 * 200


def test_deepspeed_and_plain_placements():
    zero2, zero3, nvme = (row_traffic(deepspeed_placement(r, N)) for r in ("ds-zero2-cpu", "ds-zero3-cpu-clip", "ds-zero3-nvme"))
    assert (zero2.h2d_nbytes, zero2.d2h_nbytes, zero2.cpu_update_numel) == (2 * N, 2 * N, N)
    assert (zero3.h2d_nbytes, zero3.d2h_nbytes, zero3.disk_read_nbytes) == (2 * N, 2 * N, 0)
    assert nvme.disk_read_nbytes == nvme.disk_write_nbytes == STATE_NBYTES * N
    plain = row_traffic(plain_placement(N, 8))
    assert (plain.h2d_nbytes, plain.d2h_nbytes, plain.gpu_update_numel, plain.compute_passes) == (0, 0, N, 8)


RATES = Rates(fwd_s=0.1, bwd_s=0.2, gpu_adam_s_per_param=1e-6, cpu_adam_s_per_param={4: 1e-3, 8: 5e-4},
              h2d_gbps=1e-6, d2h_gbps=2e-6, disk_read_gbps=1e-6, disk_write_gbps=1e-6)


def test_bound_is_the_largest_term_and_names_it():
    b = row_bound(placement(gpu_updated=[0]), RATES, default_threads=8)
    assert b.terms["T_gpu"] == pytest.approx(0.3 + 100 * 1e-6)
    assert b.terms["T_cpu_adam"] == pytest.approx(900 * 1e-3)  # the row's own 4 threads, not the default 8
    assert b.terms["T_h2d"] == pytest.approx(4 * (900 + 800) / 1e3)
    assert b.terms["T_d2h"] == pytest.approx(4 * 900 / 2e3)
    assert b.terms["T_nvme"] == 0.0
    assert b.seconds == pytest.approx(6.8) and b.limit == "T_h2d"
    assert "= 6.800 s (T_h2d)" in b.describe() and "T_compute 0.300 + T_gpu_update 0.000" in b.describe()


def test_bound_uses_the_bytes_moved_when_fewer_and_names_missing_rates():
    p = placement()
    moved = {"h2d": 1000.0, "d2h": 10 ** 9, "read": 0.0, "write": 0.0}
    b = row_bound(p, RATES, default_threads=8, moved=moved)
    assert b.nbytes["h2d"] == 1000 and b.nbytes["d2h"] == 4 * N  # the smaller of the two, per path
    assert b.traffic.h2d_nbytes == 4 * (2 * N - 100)  # the accounting is kept for the table
    missing = row_bound(p, Rates(cpu_adam_s_per_param={4: 1e-3}), default_threads=4)
    assert missing.terms["T_gpu"] is None and missing.terms["T_h2d"] is None
    assert missing.seconds == pytest.approx(1.0) and "T_gpu not measured" in missing.describe()
    nvme = row_bound(RowPlacement(num_params=N, resident_numel=N, disk_state_nbytes=12), Rates(), default_threads=4)
    assert nvme.terms["T_nvme"] is None and nvme.terms["T_cpu_adam"] == 0.0


def test_disk_term_is_the_longer_direction_not_their_sum():
    """Reads and writes of swapped state may overlap on the disk: the lower bound is the slower direction."""
    moments_on_disk = row_traffic(deepspeed_placement("ds-zero3-nvme", N))
    rates = dataclasses.replace(RATES, disk_read_gbps=1e-6, disk_write_gbps=2e-6)
    b = row_bound(deepspeed_placement("ds-zero3-nvme", N), rates, default_threads=8)
    read_s = moments_on_disk.disk_read_nbytes / 1e3
    write_s = moments_on_disk.disk_write_nbytes / 2e3
    assert b.terms["T_nvme"] == pytest.approx(max(read_s, write_s)) and read_s > write_s > 0
