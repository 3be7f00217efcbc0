"""`tierstore bench train` on the CPU: row names and configs, the model of the user's shape, rows run for real
(their clipping share and their bytes against the accounting), the table, and the CLI's shape options."""

from __future__ import annotations

import argparse
import logging
import math

import pytest
import torch

from runtime.bench import train_bench
from runtime.bench.deepspeed_rows import ds_config
from runtime.bench.train_bench import clipped_fraction, format_table, run_row, run_rows, versus_deepspeed
from runtime.bench.train_bound import RowPlacement, measure_disk_gbps, row_bound, row_traffic
from runtime.bench.train_model import BenchModel, batch_loss, build_model, count_params, make_batch, spec_num_params
from runtime.bench.train_rows import describe_row, row_config, row_errors, row_options
from runtime.bundled.example_model import PRESETS
from runtime.cli.main import build_parser
from runtime.config.loader import load_config

TINY_HF = BenchModel.from_preset("tiny", "hf-llama", layers=3, kv_heads=2, seq=32, micro_batch=2)


def test_row_names_and_their_errors():
    assert row_options("host-s40-t15-keep-clip") == ("host", {"s": 40, "t": 15, "keep": True, "clip": True})
    assert row_options("host-accum8-auto") == ("host-accum8", {"auto": True})
    assert row_options("nvme-auto") == ("nvme-auto", {}) and row_options("nvme-auto-auto") == ("nvme-auto", {"auto": True})
    assert row_errors(["torch", "torch-clip", "torch-accum8-clip", "ds-zero3-cpu-clip", "host-auto-clip", "nvme-auto"]) == []
    errors = row_errors(["torch-f30", "ds-zero2-cpu-keep", "host-auto-s30", "bogus-clip"])
    assert len(errors) == 4
    assert "applies to tierstore rows only" in errors[0] and "-auto chooses" in errors[2] and "unknown row 'bogus'" in errors[3]
    assert "clipping at 1.0" in describe_row("ds-zero3-cpu-clip") and "(auto)" in describe_row("host-auto")
    assert row_options("gpu-weights-f10-s40-clip-cap-nopace")[1] == {"f": 10, "s": 40, "clip": True, "cap": True, "nopace": True}
    assert "write-backs not paced" in describe_row("host-s40-nopace") and row_errors(["torch-nopace"])


def test_ckpt_rows_train_the_same_model_with_activation_checkpointing():
    """-ckpt is taken by every row (plain PyTorch and DeepSpeed too) and builds the model with activation
    checkpointing in every decoder layer; a plain row trains to the same losses with it as without."""
    import dataclasses

    assert row_errors(["torch-ckpt", "ds-zero2-cpu-clip-ckpt", "gpu-weights-auto-clip-cap-ckpt"]) == []
    assert row_options("ds-zero2-cpu-clip-ckpt") == ("ds-zero2-cpu", {"ckpt": True, "clip": True})
    assert "activation checkpointing" in describe_row("torch-ckpt")
    ckpt = dataclasses.replace(TINY_HF, checkpointing=True)
    assert BenchModel.from_json(ckpt.to_json()) == ckpt and "activation checkpointing" in ckpt.describe()
    assert build_model(ckpt).model.gradient_checkpointing and not build_model(TINY_HF).model.gradient_checkpointing
    example = BenchModel.from_preset("tiny", seq=32, micro_batch=2, checkpointing=True)
    assert build_model(example).activation_checkpointing
    plain, checkpointed = run_row("torch", TINY_HF, steps=3, nvme_dir=None), run_row("torch-ckpt", TINY_HF, steps=3, nvme_dir=None)
    assert checkpointed["loss"] == plain["loss"]
    # A -cap row's cap never comes from a -ckpt ZeRO-2 row (its activations take far less), listed first or not.
    results = {"ds-zero2-cpu-clip-ckpt": {"peak_gpu_reserved_nbytes": 9 << 30}, "ds-zero2-cpu-clip": {"peak_gpu_reserved_nbytes": 31 << 30}}
    assert train_bench._measured(results, "ds-zero2-cpu", "peak_gpu_reserved_nbytes") == (31 << 30, "ds-zero2-cpu-clip")


def test_row_config_emits_auto_only_for_auto_rows():
    auto = row_config("host-auto-clip", None)
    assert auto["optimizer"]["gpu_update_fraction"] == "auto" and auto["optimizer"]["gpu_stream_fraction"] == "auto"
    assert auto["prefetch"]["keep_for_backward"] == "auto" and auto["optimizer"]["grad_clip"] == 1.0
    plain = row_config("host", None)  # no suffix: today's meaning, explicit zeros
    assert (plain["optimizer"]["gpu_update_fraction"], plain["optimizer"]["gpu_stream_fraction"]) == (0, 0)
    assert plain["prefetch"]["keep_for_backward"] == 0 and plain["optimizer"]["grad_clip"] is None
    keep = row_config("gpu-weights-f10-s40-a3-keep", None)
    assert keep["optimizer"]["gpu_update_fraction"] == 0.1 and keep["optimizer"]["gpu_stream_ahead"] == 3
    assert keep["prefetch"]["keep_for_backward"] == "4GiB" and keep["placement"]["weights"] == "gpu"
    for row in ("host", "gpu-weights-f10-s40-keep-clip", "nvme-t4", "nvme-auto"):  # the schema takes what we emit
        load_config(row_config(row, "tmp"))


def test_deepspeed_configs():
    assert ds_config("ds-zero3-cpu", 8, None)["gradient_clipping"] == 0.0
    assert ds_config("ds-zero3-cpu-clip", 8, None)["gradient_clipping"] == 1.0
    nvme = ds_config("ds-zero3-nvme", 8, "/d")
    assert nvme["aio"] == {"block_size": 8 << 20, "queue_depth": 8, "thread_count": 8, "single_submit": False,
                           "overlap_events": True}
    optimizer = nvme["zero_optimization"]["offload_optimizer"]
    assert optimizer["buffer_count"] == 8 and not optimizer["pipeline_read"] and not optimizer["pipeline_write"]
    with pytest.raises(ValueError, match="--nvme-dir"):
        ds_config("ds-zero3-nvme", 8, None)


def test_model_shape_defaults_overrides_and_refusals():
    default = BenchModel.from_preset("1.35b")
    shape = PRESETS["1.35b"]
    assert (default.hidden, default.layers, default.heads, default.kv_heads) == \
        (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_heads)
    assert (default.seq, default.micro_batch) == (1024, 8)
    assert BenchModel.from_preset("tiny", heads=8).kv_heads == 8
    assert BenchModel.from_json(TINY_HF.to_json()) == TINY_HF
    with pytest.raises(ValueError, match="pass --model hf-llama"):
        BenchModel.from_preset("tiny", kv_heads=2)
    with pytest.raises(ValueError, match="not a multiple of --kv-heads"):
        BenchModel.from_preset("tiny", "hf-llama", kv_heads=3)
    with pytest.raises(ValueError, match="--preset huge"):
        BenchModel.from_preset("huge")


def test_parameter_counts_come_from_the_built_model():
    example = BenchModel.from_preset("tiny")
    assert spec_num_params(example) == PRESETS["tiny"].num_params == count_params(build_model(example))
    untied = BenchModel.from_preset("tiny", "hf-llama", tied=False)
    tied = BenchModel.from_preset("tiny", "hf-llama", tied=True)
    assert spec_num_params(untied) - spec_num_params(tied) == untied.vocab * untied.hidden
    assert spec_num_params(TINY_HF) == count_params(build_model(TINY_HF))
    fewer_kv = BenchModel.from_preset("tiny", "hf-llama", kv_heads=1)
    assert spec_num_params(fewer_kv) < spec_num_params(BenchModel.from_preset("tiny", "hf-llama"))


@pytest.mark.parametrize("spec", [BenchModel.from_preset("tiny", seq=16, micro_batch=3), TINY_HF])
def test_one_batch_and_loss_serve_both_model_kinds(spec):
    inputs, targets = make_batch(spec, torch.device("cpu"), 0)
    assert inputs.shape == targets.shape == (spec.micro_batch, spec.seq)
    assert torch.equal(targets, inputs) == (spec.kind == "hf-llama")  # HF shifts labels itself
    loss = batch_loss(spec, build_model(spec), (inputs, targets))
    assert loss.dim() == 0 and abs(loss.item() - math.log(spec.vocab)) < 1.0  # random init: about uniform


def test_clipped_fraction():
    assert clipped_fraction([0.5, 2.0, 3.0, None]) == pytest.approx(2 / 3)
    assert clipped_fraction([1.0]) == 1.0  # coefficient 1 / (1 + 1e-6): below 1, as torch computes it
    assert clipped_fraction([1.0 - 1e-5]) == 0.0
    assert clipped_fraction([None]) is None and clipped_fraction([]) is None


@pytest.mark.parametrize("row", ["torch-clip", "host-clip", "host-s30-keep", "host-accum8"])
def test_rows_run_and_move_what_the_accounting_says(row):
    result = run_row(row, TINY_HF, steps=3, nvme_dir=None)
    assert result["num_params"] == spec_num_params(TINY_HF)
    assert result["step_s"] > 0 and result["peak_rss_nbytes"] > 0
    if row.endswith("clip"):
        assert result["clipped"] is not None and 0 <= result["clipped"] <= 1
    else:
        assert result["clipped"] is None
    if row == "host-clip":  # every step clips: the first runs its host updates early, the next hold every gradient
        assert result["clipped"] == 1.0
        assert result["held_per_step"] == [0] + [result["host_blocks"]] * 2 and result["host_blocks"] > 0
    elif not row.startswith("torch"):
        assert not any(result["held_per_step"])  # nothing to multiply, nothing held
    placement = RowPlacement(**result["placement"])
    if row.startswith("torch"):
        assert placement.gpu_update_numel == placement.num_params == result["num_params"]
        return
    traffic = row_traffic(placement)
    moved = result["moved_nbytes"]
    assert traffic.h2d_nbytes > 0 and moved["h2d"] == traffic.h2d_nbytes
    assert moved["d2h"] == traffic.d2h_nbytes


def test_nvme_row_reads_and_writes_its_moments(tmpfs_dir):
    result = run_row("nvme-keep", TINY_HF, steps=4, nvme_dir=str(tmpfs_dir))
    traffic = row_traffic(RowPlacement(**result["placement"]))
    assert traffic.disk_read_nbytes == 8 * result["num_params"]  # both moments of every block
    assert result["moved_nbytes"]["read"] > 0 and result["moved_nbytes"]["write"] > 0


@pytest.mark.slow
def test_rows_in_their_own_processes_and_the_table(tmpfs_dir):
    args = argparse.Namespace(steps=3, nvme_dir=None, gpu_cap=None)
    results = run_rows(["torch", "host-clip", "nvme-auto"], TINY_HF, args)
    assert "needs the ds-zero3-cpu" in results["nvme-auto"]["error"]
    assert results["host-clip"]["num_params"] == spec_num_params(TINY_HF)
    rates = train_bench.measure_rates(results, spec_num_params(TINY_HF), None, default_threads=2)
    assert rates.fwd_s == results["torch"]["fwd_s"] and set(rates.cpu_adam_s_per_param) == {2}
    bounds = {row: row_bound(RowPlacement(**r["placement"]), rates, 2, r.get("moved_nbytes"))
              for row, r in results.items() if "placement" in r}
    table = format_table(["torch", "host-clip", "nvme-auto"], results, bounds, rates, TINY_HF, spec_num_params(TINY_HF))
    lines = table.splitlines()
    assert "of bound" in lines[3] and "clipped" in lines[3]
    host = next(line for line in lines if line.startswith("host-clip "))
    assert "clipping at 1.0" in host
    assert any(line.startswith("bound host-clip: max(T_gpu") and "moved" in line for line in lines)
    assert any(line.startswith("held gradients host-clip: [0, ") for line in lines)
    time_line = next(line for line in lines if line.startswith("time host-clip: the forward waited "))
    assert "G params/s in the step" in time_line and results["host-clip"]["host_numel"] > 0
    assert len(results["host-clip"]["kernel_s_per_step"]) == 3 and sum(results["host-clip"]["kernel_s_per_step"]) > 0
    assert any(line.startswith("nvme-auto") and "failed" in line for line in lines)


def test_nvme_auto_is_capped_by_zero3_cpu_first():
    args = argparse.Namespace(steps=3, nvme_dir="/d", gpu_cap=None)
    results = {"ds-zero3-nvme": {"peak_rss_nbytes": 30 << 30}, "ds-zero3-cpu-clip": {"peak_rss_nbytes": 20 << 30}}
    cmd = train_bench._child_command("nvme-auto", TINY_HF, args, "out.json", results)
    assert cmd[cmd.index("--host-cap") + 1] == str(20 << 30)
    del results["ds-zero3-cpu-clip"]
    cmd = train_bench._child_command("nvme-auto", TINY_HF, args, "out.json", results)
    assert cmd[cmd.index("--host-cap") + 1] == str(30 << 30)
    assert BenchModel.from_json(cmd[cmd.index("--spec") + 1]) == TINY_HF
    assert "needs the ds-zero2-cpu row" in train_bench._child_command("host-cap", TINY_HF, args, "o.json", results)
    results["ds-zero2-cpu-clip"] = {"peak_gpu_reserved_nbytes": 7 << 30}
    cmd = train_bench._child_command("host-cap", TINY_HF, args, "o.json", results)
    assert cmd[cmd.index("--gpu-cap") + 1] == str(7 << 30)
    args.gpu_cap = 24 << 30  # --gpu-cap: the user's card size, over the DeepSpeed row's reservation
    cmd = train_bench._child_command("host-cap", TINY_HF, args, "o.json", {})
    assert cmd[cmd.index("--gpu-cap") + 1] == str(24 << 30)
    results = {"ds-zero3-cpu": {"step_s": 1.0, "peak_rss_nbytes": 20 << 30},
               "nvme-auto": {"step_s": 0.5, "peak_rss_nbytes": 19 << 30, "host_cap_from": "ds-zero3-cpu"}}
    lines = versus_deepspeed(results)
    assert "tokens/s vs ds-zero3-cpu (1.000 s/step): nvme-auto 2.00x" in lines[0]
    assert lines[1].startswith("nvme-auto vs ds-zero3-cpu at the same host RAM") and "2.00x the tokens/s" in lines[1]


def test_disk_ceiling_measures_either_way(tmpfs_dir, caplog):
    from runtime.profiler import ceilings

    with caplog.at_level(logging.WARNING):
        read, write = measure_disk_gbps(str(tmpfs_dir), total_nbytes=64 << 20)
    assert read > 0 and write > 0
    fallback = not hasattr(ceilings, "disk_ceiling_gbps")
    assert ("single-stream dd" in caplog.text) == fallback
    assert [p.name for p in tmpfs_dir.iterdir()] == []  # nothing left behind


def test_cli_shape_options():
    args = build_parser().parse_args(["bench", "train", "--model", "hf-llama", "--preset", "tiny", "--kv-heads", "2",
                                      "--seq", "128", "--micro-batch", "2", "--no-tied", "--hidden", "128"])
    spec = BenchModel.from_args(args)
    assert (spec.kind, spec.kv_heads, spec.seq, spec.micro_batch, spec.tied, spec.hidden) == ("hf-llama", 2, 128, 2, False, 128)
    assert spec.layers == PRESETS["tiny"].num_layers and spec.heads == PRESETS["tiny"].num_heads
    default = BenchModel.from_args(build_parser().parse_args(["bench", "train"]))
    assert default == BenchModel.from_preset("1.35b")


def test_rows_choose_how_the_layers_activations_are_placed():
    """-auto rows leave placement.activations to the runtime; -norc keeps them there, -rc recomputes them on any
    tierstore row; rows without either keep them (a hand-set row runs what it names)."""
    from runtime.bench.train_rows import describe_row, row_config, row_errors

    activations = {row: row_config(row, None)["placement"]["activations"]
                   for row in ("gpu-weights-auto-clip-cap", "gpu-weights-auto-clip-cap-norc", "host-s40-rc", "host",
                               "nvme")}
    assert activations == {"gpu-weights-auto-clip-cap": "auto", "gpu-weights-auto-clip-cap-norc": "keep",
                           "host-s40-rc": "recompute", "host": "keep", "nvme": "keep"}
    assert "activations recomputed" in describe_row("host-s40-rc")
    assert row_errors(["host-norc"]) and row_errors(["host-rc-ckpt"]) and row_errors(["torch-rc"])
    assert not row_errors(["gpu-weights-auto-clip-cap-norc", "host-rc-clip"])
