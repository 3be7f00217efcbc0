"""The oversized-training example runs end to end at a small size: meta build, three tiers, falling loss."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _example():
    path = Path(__file__).resolve().parents[2] / "examples" / "train_oversized.py"
    spec = importlib.util.spec_from_file_location("train_oversized", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.slow
def test_small_run_trains_through_all_tiers(tmpfs_dir, capsys):
    rc = _example().main(["--hidden", "64", "--layers", "3", "--ffn", "128", "--vocab", "256", "--seq-len", "32",
                          "--batch-size", "2", "--steps", "6", "--lr", "3e-3", "--nvme-dir", str(tmpfs_dir),
                          "--nvme-budget", "1GiB"])
    assert rc == 0  # losses finite and decreasing
    report = capsys.readouterr().out
    assert "NVMe -> pinned" in report  # the moments really went through the NVMe tier
    read_line = next(line for line in report.splitlines() if line.startswith("NVMe -> pinned"))
    assert float(read_line.split()[3]) > 0  # MiB read from NVMe


def test_plan_only_for_a_10b_model(capsys):
    assert _example().main(["--hidden", "5120", "--layers", "32", "--ffn", "13824", "--plan-only"]) == 0
    assert "nvme" in capsys.readouterr().out
