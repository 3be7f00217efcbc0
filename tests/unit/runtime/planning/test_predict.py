"""The step-time model of ``tierstore plan --model`` (runtime.planning.predict): its arithmetic at known rates."""

from __future__ import annotations

import pytest

from runtime.planning.predict import (
    MICRO_BATCH_OVERHEAD_S,
    ModelShape,
    RowPlacement,
    StepRates,
    Work,
    activation_nbytes,
    predict_step,
    row_traffic,
    training_flops,
)

SHAPE = ModelShape(num_params=1_000_000, matmul_params=800_000, num_layers=2, attention_width=64, hidden=64, ffn=256,
                   vocab=1000)
WORK = Work(seq=100, micro_batch=2, accumulation=3)  # 600 tokens a step


def rates(**changes: float) -> StepRates:
    base = {"matmul_flops_per_s": 1e12, "h2d_bytes_per_s": 1e9, "d2h_bytes_per_s": 2e9, "cpu_adam_params_per_s": 1e8,
            "disk_read_bytes_per_s": 1e9, "disk_write_bytes_per_s": 5e8, "gpu_adam_params_per_s": 1e10,
            "compute_efficiency": 0.5}
    return StepRates(**{**base, **changes})


def test_training_flops_count_matmuls_recompute_and_causal_attention():
    dense = 8 * 800_000 * 600  # 6 M T + 2 M T recomputed
    attention = 4 * 2 * 2 * 2 * 100 ** 2 * 64 * 3  # four forwards' worth of 2 L b s^2 d, three micro-batches
    assert training_flops(SHAPE, WORK) == dense + attention
    no_recompute = Work(seq=100, micro_batch=2, accumulation=3, recompute=False)
    assert training_flops(SHAPE, no_recompute) == 6 * 800_000 * 600 + 3 * 2 * 2 * 2 * 100 ** 2 * 64 * 3


def test_updates_after_backward_add_to_the_micro_batches():
    placement = RowPlacement(num_params=1_000_000, accumulation=3, fetch_elem_nbytes=4, cpu_update_numel=1_000_000)
    t = row_traffic(placement)
    assert t.fetch_nbytes == t.h2d_nbytes == 4 * 3 * 2 * 1_000_000  # fetched for each forward and backward
    p = predict_step(placement, SHAPE, WORK, rates(), updates_after_backward=True)
    compute = training_flops(SHAPE, WORK) / (1e12 * 0.5)
    fetch = t.fetch_nbytes / 1e9
    assert p.terms["T_compute"] == pytest.approx(compute) and p.terms["T_fetch"] == pytest.approx(fetch)
    assert p.terms["T_cpu"] == pytest.approx(1_000_000 / 1e8)
    assert p.terms["T_d2h"] == pytest.approx(4 * 1_000_000 / 2e9)
    expected = max(compute, fetch) + max(1_000_000 / 1e8, 4 * 1_000_000 / 2e9) + 3 * MICRO_BATCH_OVERHEAD_S
    assert p.step_s == pytest.approx(expected)
    assert p.tokens_per_s == pytest.approx(600 / expected)
    assert p.limit == "T_fetch"  # 24 MB at 1 GB/s beside 8.5 ms of compute


def test_stated_rates_change_the_prediction_as_the_arithmetic_says():
    placement = RowPlacement(num_params=1_000_000, accumulation=3, fetch_elem_nbytes=4, cpu_update_numel=1_000_000,
                             disk_state_nbytes=8_000_000)
    slow = predict_step(placement, SHAPE, WORK, rates(), updates_after_backward=True)
    fast_pcie = predict_step(placement, SHAPE, WORK, rates(h2d_bytes_per_s=4e9), updates_after_backward=True)
    assert fast_pcie.terms["T_fetch"] == pytest.approx(slow.terms["T_fetch"] / 4)
    assert slow.terms["T_nvme"] == pytest.approx(8_000_000 / 5e8)  # the slower of reads and writes
    slow_disk = predict_step(placement, SHAPE, WORK, rates(disk_write_bytes_per_s=1e8), updates_after_backward=True)
    # T_nvme was the largest term after the backward already: the step grows by its growth
    assert slow_disk.limit == "T_nvme" and slow_disk.step_s - slow.step_s == pytest.approx(0.08 - 0.016)
    faster_gpu = predict_step(placement, SHAPE, WORK, rates(matmul_flops_per_s=2e12), updates_after_backward=True)
    assert faster_gpu.terms["T_compute"] == pytest.approx(slow.terms["T_compute"] / 2)


def test_updates_during_the_backward_take_the_largest_term():
    placement = RowPlacement(num_params=1_000_000, accumulation=3, resident_numel=1_000_000, gpu_update_numel=400_000,
                             cpu_update_numel=600_000, refresh_elem_nbytes=4)
    p = predict_step(placement, SHAPE, WORK, rates(cpu_adam_params_per_s=1e7), updates_after_backward=False)
    assert p.terms["T_fetch"] == 0 and p.terms["T_h2d"] == pytest.approx(4 * 600_000 / 1e9)
    assert p.step_s == pytest.approx(600_000 / 1e7 + 3 * MICRO_BATCH_OVERHEAD_S) and p.limit == "T_cpu"
    fast_cpu = predict_step(placement, SHAPE, WORK, rates(cpu_adam_params_per_s=1e9), updates_after_backward=False)
    compute = training_flops(SHAPE, WORK) / 5e11 + 400_000 / 1e10  # the GPU's compute and its updates, in turn
    assert fast_cpu.step_s == pytest.approx(compute + 3 * MICRO_BATCH_OVERHEAD_S)
    assert fast_cpu.limit == "T_compute + T_gpu_update"


def test_activations_grow_with_the_micro_batch_and_the_vocabulary():
    one = activation_nbytes(SHAPE, Work(seq=100, micro_batch=1, accumulation=1))
    two = activation_nbytes(SHAPE, Work(seq=100, micro_batch=2, accumulation=1))
    assert two - one == one - (1 << 30)  # linear in the tokens above the fixed slack
    logits = 100 * 1000 * 12
    assert one == 2 * 100 * 64 * 2 + 2 * 100 * (10 * 64 + 4 * 256) * 2 + logits + (1 << 30)


def test_a_chunked_loss_keeps_only_a_piece_of_the_logits():
    whole = activation_nbytes(SHAPE, Work(seq=100, micro_batch=2, accumulation=1))
    piece = activation_nbytes(SHAPE, Work(seq=100, micro_batch=2, accumulation=1, loss_piece_tokens=50))
    assert whole - piece == (200 - 50) * 1000 * 12  # 12 bytes a logit of the tokens not held at once
    larger = activation_nbytes(SHAPE, Work(seq=100, micro_batch=2, accumulation=1, loss_piece_tokens=10_000))
    assert larger == whole  # a piece longer than the micro-batch holds what HF's loss holds
