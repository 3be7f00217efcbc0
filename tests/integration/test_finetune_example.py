"""examples/finetune_8b.py, the 8B workstation scenario, on a shape small enough for the CPU: it trains an HF
Llama built on the meta device with checkpointing, accumulation and clipping, and its --plan-only says
whether the plan fits, with the plan."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SMALL = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "512",
         "--seq", "64"]


def load_example():
    path = Path(__file__).resolve().parents[2] / "examples" / "finetune_8b.py"
    spec = importlib.util.spec_from_file_location("finetune_8b", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_trains_with_falling_loss_and_prints_each_step(tmp_path, capsys):
    example = load_example()
    code = example.main(SMALL + ["--global-batch", "4", "--micro-batch", "2", "--steps", "4", "--lr", "3e-3",
                                 "--nvme-dir", str(tmp_path), "--host-budget", "1GiB"])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    assert "finite and falling" in err
    assert err.count("model TFLOP/s") == 4 and "micro-batch 2/2" in err


@pytest.mark.slow
@pytest.mark.parametrize("piece", [0, 40])
def test_the_loss_taken_piecewise_trains_like_hf_s_own(tmp_path, capsys, piece):
    """--loss-piece 40: the head runs on 20 positions of 2 sequences at a time (4 pieces of 63), HF's loss not at
    all; 0: HF's own loss. Both train with falling loss."""
    example = load_example()
    code = example.main(SMALL + ["--global-batch", "4", "--micro-batch", "2", "--steps", "4", "--lr", "3e-3",
                                 "--nvme-dir", str(tmp_path), "--host-budget", "1GiB", "--loss-piece", str(piece)])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    assert "finite and falling" in err


def test_plan_only_shows_the_spill_and_whether_it_fits(tmp_path, capsys):
    example = load_example()
    # A host budget too small for every block's moments: the last blocks' moments are planned on NVMe.
    code = example.main(SMALL + ["--plan-only", "--nvme-dir", str(tmp_path), "--host-budget", "3MiB"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "fits this machine" in out and "nvme" in out and "exp_avg" in out


def test_a_swap_directory_that_does_not_exist_yet_is_made_private(tmp_path, capsys):
    """The README's command names /var/tmp/ts-8b, which a fresh machine does not have: it stopped with a traceback."""
    example = load_example()
    swap = tmp_path / "not" / "yet"
    code = example.main(SMALL + ["--plan-only", "--nvme-dir", str(swap), "--host-budget", "3MiB"])
    assert code == 0, capsys.readouterr().out
    assert swap.is_dir() and (swap.stat().st_mode & 0o777) == 0o700


def test_plan_only_refuses_what_this_machine_cannot_hold(tmp_path, capsys):
    example = load_example()
    code = example.main(SMALL + ["--plan-only", "--nvme-dir", str(tmp_path), "--host-budget", "100TiB"])
    out = capsys.readouterr().out
    assert code == 1
    assert "does not fit this machine" in out and "tiers.host.budget" in out


def test_the_piecewise_loss_and_its_gradients_equal_hf_s():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    example = load_example()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=97, max_position_embeddings=64)
    hf = LlamaForCausalLM(config)
    tokens = torch.randint(0, 97, (3, 50))
    expected = hf(input_ids=tokens, labels=tokens).loss
    expected.backward()
    grads = {name: p.grad.clone() for name, p in hf.named_parameters()}
    hf.zero_grad()
    loss = example.PiecewiseLossLM(hf, piece_tokens=40)(tokens)  # 13 positions of 3 sequences a piece: 4 pieces
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_under_a_tight_gpu_budget_the_gradients_are_summed_on_the_host(tmp_path, capsys):
    """The scenario's path on the CPU: a GPU budget four times smaller than the model's gradients makes
    accumulate_on: auto sum them on the host, the loss is taken piecewise, moments spill past the host budget;
    it trains with falling loss and prints what the host sums cost."""
    example = load_example()
    deeper = list(SMALL)
    deeper[SMALL.index("--layers") + 1] = "8"  # with 8 layers, spilling the last ones' moments saves host memory
    code = example.main(deeper + ["--global-batch", "4", "--micro-batch", "2", "--steps", "4", "--lr", "3e-3",
                                  "--nvme-dir", str(tmp_path), "--host-budget", "6MiB", "--gpu-cap", "4MiB",
                                  "--loss-piece", "40"])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert "accumulate_on: auto -> host" in err and "spilled blocks" in err
    assert "finite and falling" in err and err.count("host gradient sums:") == 4


@pytest.mark.slow
def test_a_long_setup_reports_its_progress(tmp_path, caplog, monkeypatch):
    """Setting up 8B takes about two minutes (pinning 100 GiB, initializing and writing blocks): the pinning and
    the blocks set up so far are logged as they go (here with the thresholds at zero)."""
    import logging

    monkeypatch.setattr("runtime.engine.relocation.SETUP_PROGRESS_S", 0.0)
    monkeypatch.setattr("runtime.session.LONG_SETUP_NBYTES", 0)
    caplog.set_level(logging.INFO, logger="runtime")
    example = load_example()
    assert example.main(SMALL + ["--global-batch", "2", "--micro-batch", "2", "--steps", "1",
                                 "--nvme-dir", str(tmp_path), "--host-budget", "1GiB"]) in (0, 1)
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith(("pinning ", "reserving ")) and "of host memory" in m for m in messages)
    assert any(m.startswith("setting up block 2 of ") for m in messages)


def load_deepspeed_baseline():
    examples = Path(__file__).resolve().parents[2] / "examples"
    spec = importlib.util.spec_from_file_location("finetune_8b_deepspeed", examples / "finetune_8b_deepspeed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_deepspeed_baseline_s_watchdog_names_the_phase_that_passed_the_limit():
    """DeepSpeed has no host budget: the baseline's watchdog enforces the scenario's limit from outside, once."""
    baseline = load_deepspeed_baseline()
    readings = iter([10, 20, 150, 160, 170])
    seen = []
    watchdog = baseline.RssWatchdog(100, lambda rss, phase: seen.append((rss, phase)), interval_s=0.01,
                                    rss=lambda: next(readings, 170))
    watchdog.phase = "deepspeed.initialize"
    watchdog.start()
    watchdog._thread.join(timeout=5)
    assert seen == [(150, "deepspeed.initialize")] and watchdog.peak_nbytes == 150


def test_the_deepspeed_baseline_does_the_scenario_s_work():
    """Same batch, accumulation, clipping, dtype and AdamW as the tierstore script; nvme gets the tuned aio."""
    baseline = load_deepspeed_baseline()
    args = baseline.parse_args(["--offload", "nvme", "--nvme-dir", "/somewhere"])
    config = baseline.ds_config(args, args.global_batch // args.micro_batch)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (4, 16)
    assert config["gradient_clipping"] == 1.0 and config["bf16"]["enabled"]
    from runtime.config.loader import load_config

    ours = load_config(load_example().tierstore_config(load_example().parse_args([]), cuda=True)).optimizer
    params = config["optimizer"]["params"]
    assert (params["lr"], tuple(params["betas"]), params["eps"], params["weight_decay"]) == (
        ours.lr, tuple(ours.betas), ours.eps, ours.weight_decay)
    assert (config["gradient_clipping"], config["gradient_accumulation_steps"]) == (ours.grad_clip, ours.accumulation_steps)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu"
    assert zero["offload_optimizer"]["nvme_path"] == "/somewhere" and config["aio"]["thread_count"] == 8
    assert baseline.ds_config(baseline.parse_args([]), 16)["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_a_set_activation_reserve_reaches_the_config():
    example = load_example()
    args = example.parse_args(["--activation-reserve", "5GiB"])
    assert example.tierstore_config(args, cuda=True)["tiers"]["gpu"]["activation_reserve"] == "5GiB"
    assert example.tierstore_config(example.parse_args([]), cuda=True)["tiers"]["gpu"]["activation_reserve"] == "auto"


def test_the_io_settings_reach_the_config():
    """--io-threads and --io-block (what the disk sweep recommends) become tiers.nvme's io_threads and block_size,
    and the schema takes them."""
    from runtime.config.loader import load_config

    example = load_example()
    config = example.tierstore_config(example.parse_args(["--io-threads", "2", "--io-block", "256MiB"]), cuda=True)
    assert config["tiers"]["nvme"]["io_threads"] == 2 and config["tiers"]["nvme"]["block_size"] == "256MiB"
    loaded = load_config(config)
    assert loaded.tiers.nvme.io_threads == 2 and loaded.tiers.nvme.block_size == 256 << 20
    defaults = example.tierstore_config(example.parse_args([]), cuda=True)["tiers"]["nvme"]
    assert (defaults["io_threads"], defaults["block_size"]) == (8, "64MiB")


def test_any_other_setting_reaches_the_config_through_set():
    """--set KEY=VALUE puts a YAML value at a dotted path (a new section or beside the scenario's own keys), the
    schema takes it, a malformed one names what to write instead, and a setting one of the script's flags makes
    names that flag."""
    from runtime.config.loader import load_config

    example = load_example()
    args = example.parse_args(["--set", "prefetch.keep_for_backward=0", "--set", "optimizer.gpu_stream_fraction=0.25",
                               "--set", "blocks.min_block_size=1024"])
    config = example.tierstore_config(args, cuda=True)
    assert config["prefetch"] == {"keep_for_backward": 0}  # the scenario's own setting, set again
    assert config["optimizer"]["gpu_stream_fraction"] == 0.25 and config["optimizer"]["grad_clip"] == 1.0
    assert config["blocks"] == {"min_block_size": 1024}  # a section the scenario does not set
    loaded = load_config(config)
    assert loaded.prefetch.keep_for_backward == 0 and loaded.optimizer.gpu_stream_fraction == 0.25
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        example.tierstore_config(example.parse_args(["--set", "prefetch.keep_for_backward"]), cuda=True)
    with pytest.raises(SystemExit, match="not a section"):
        example.tierstore_config(example.parse_args(["--set", "optimizer.lr.x=1"]), cuda=True)
    with pytest.raises(SystemExit, match="tiers.gpu is a section; set one of its keys"):
        example.tierstore_config(example.parse_args(["--set", "tiers.gpu=1"]), cuda=True)
    with pytest.raises(SystemExit, match="not YAML"):
        example.tierstore_config(example.parse_args(["--set", "optimizer.weight_decay=[1"]), cuda=True)
    for key, flag in [("tiers.gpu.activation_reserve=3GiB", "--activation-reserve"), ("dtype=fp16", "the device"),
                      ("optimizer.accumulation_steps=2", "--global-batch / --micro-batch")]:
        with pytest.raises(SystemExit, match=f"comes from {flag}"):
            example.tierstore_config(example.parse_args(["--set", key]), cuda=True)


@pytest.mark.slow
def test_trace_writes_a_profile_of_two_micro_batches(tmp_path, capsys):
    """--trace FILE: torch.profiler over micro-batches 2 and 3 of the last step (the CPU's ops here, the GPU's
    kernels and copies on a GPU), written as a Chrome trace, gzipped for a .gz name."""
    import gzip
    import json

    example = load_example()
    trace = tmp_path / "trace.json.gz"
    code = example.main(SMALL + ["--global-batch", "8", "--micro-batch", "2", "--steps", "2", "--lr", "3e-3",
                                 "--nvme-dir", str(tmp_path), "--host-budget", "1GiB", "--trace", str(trace)])
    assert code == 0, capsys.readouterr().err[-2000:]
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"aten::mm", "aten::addmm", "aten::matmul"} & names  # the model's matmuls were recorded


def test_compute_bound_needs_a_gpu(monkeypatch):
    """--compute-bound times the micro-batches with the whole model on the GPU: without one it says so."""
    example = load_example()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a GPU"):
        example.main(SMALL + ["--compute-bound"])


@pytest.mark.slow
def test_under_torchrun_two_ranks_report_the_one_process_losses(tmp_path):
    """torchrun --nproc-per-node 2 examples/finetune_8b.py (issue 42): each rank takes its rows of every micro-batch
    of the same stream, so in fp32 on the CPU the two ranks' step losses are the one process's at the same global
    batch, and the swap files of both ranks are gone at the end."""
    import os
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    flags = SMALL + ["--global-batch", "8", "--micro-batch", "2", "--steps", "3", "--lr", "3e-3", "--host-budget", "1GiB"]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)

    def step_losses(*launcher: str, nvme: Path) -> list[str]:
        done = subprocess.run([sys.executable, *launcher, str(root / "examples" / "finetune_8b.py"), *flags,
                               "--nvme-dir", str(nvme)], env=env, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        assert not [p for p in nvme.rglob("*") if p.is_file()], "swap files left"
        return re.findall(r"step \d/3: loss (\d+\.\d+)", done.stderr.replace("\r", "\n"))

    one = step_losses(nvme=tmp_path / "one")
    two = step_losses("-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", nvme=tmp_path / "two")
    assert len(one) == 3 and two == one
