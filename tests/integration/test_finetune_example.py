"""examples/finetune_8b.py, the 8B workstation scenario, on a shape small enough for the CPU: it trains an HF
Llama built on the meta device with checkpointing, accumulation and clipping, and its --plan-only says
whether the plan fits, with the plan."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

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


def test_trains_with_falling_loss_and_prints_each_step(tmp_path, capsys):
    example = load_example()
    code = example.main(SMALL + ["--global-batch", "4", "--micro-batch", "2", "--steps", "4", "--lr", "3e-3",
                                 "--nvme-dir", str(tmp_path), "--host-budget", "1GiB"])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    assert "finite and falling" in err
    assert err.count("model TFLOP/s") == 4 and "micro-batch 2/2" in err


def test_plan_only_shows_the_spill_and_whether_it_fits(tmp_path, capsys):
    example = load_example()
    # A host budget too small for every block's moments: the last blocks' moments are planned on NVMe.
    code = example.main(SMALL + ["--plan-only", "--nvme-dir", str(tmp_path), "--host-budget", "3MiB"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "fits this machine" in out and "nvme" in out and "exp_avg" in out


def test_plan_only_refuses_what_this_machine_cannot_hold(tmp_path, capsys):
    example = load_example()
    code = example.main(SMALL + ["--plan-only", "--nvme-dir", str(tmp_path), "--host-budget", "100TiB"])
    out = capsys.readouterr().out
    assert code == 1
    assert "does not fit this machine" in out and "tiers.host.budget" in out
