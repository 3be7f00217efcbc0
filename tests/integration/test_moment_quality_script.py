"""examples/moment_quality.py, the issue-43 quality run, on the CPU at a tiny shape: every row starts from the same
weights and batch, the compact-moment rows follow fp32 moments, the results merge into one JSON, a row whose package
is missing records the error while the others run, and an unknown row is refused naming the valid ones."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--seq", "32",
        "--batch", "2", "--steps", "6", "--eval-every", "3", "--eval-batches", "2", "--corpus-bytes", "1000000",
        "--host", "--moment-kernel", "torch", "--device", "cpu"]


def load_script(monkeypatch):
    """The script as a module (registered in sys.modules for the test: its dataclasses look their module up)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "moment_quality.py"
    spec = importlib.util.spec_from_file_location("moment_quality", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "moment_quality", module)
    spec.loader.exec_module(module)
    return module


def test_rows_share_the_start_and_compact_moments_follow_fp32(tmp_path, monkeypatch, capsys):
    script = load_script(monkeypatch)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # not installed in CI either way: the import fails
    out = tmp_path / "quality.json"
    code = script.main(TINY + ["--rows", "ts-fp32,ts-int8,torch-fp32,bnb-8bit", "--json", str(out)])
    printed = capsys.readouterr()
    assert code == 1  # the bnb row failed
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"ts-fp32", "ts-int8", "torch-fp32", "bnb-8bit"}
    assert "bitsandbytes" in rows["bnb-8bit"]["error"] and rows["bnb-8bit"]["final_eval_loss"] is None
    for name in ("ts-fp32", "ts-int8", "torch-fp32"):
        r = rows[name]
        assert r["error"] is None
        assert len(r["train_loss"]) == 6 and all(math.isfinite(v) for v in r["train_loss"])
        assert [p[0] for p in r["eval"]] == [0, 3, 6] and math.isfinite(r["final_eval_loss"])
        assert r["seconds_per_step"] > 0
    # the same init and the same first batch: bf16 compute (tierstore) against fp32 weights under bf16 autocast
    first = rows["ts-fp32"]["train_loss"][0]
    for name in ("ts-int8", "torch-fp32"):
        assert rows[name]["train_loss"][0] == pytest.approx(first, rel=1e-2)
    assert rows["ts-int8"]["train_loss"][0] == first  # the same weights and compute: the moments are not used yet
    starts = {rows[name]["eval"][0][1] for name in ("ts-fp32", "ts-int8")}
    assert len(starts) == 1 and rows["torch-fp32"]["eval"][0][1] == pytest.approx(starts.pop(), rel=1e-2)
    assert rows["ts-int8"]["final_eval_loss"] == pytest.approx(rows["ts-fp32"]["final_eval_loss"], rel=2e-2)
    # the moments were checked stored in the row's format (host placement on the CPU)
    assert rows["ts-int8"]["moment_homes"] == ["host"] and rows["ts-int8"]["blocks"] >= 2
    assert "held-out loss" in printed.out and "ts-int8" in printed.out
    assert "rows that failed: bnb-8bit" in printed.err


def test_resident_rows_keep_compact_moments_on_the_device(tmp_path, monkeypatch):
    """Without --host the moments live with the weights on the compute device (the CPU here: the device update
    path runs there too), updated there for every block, stored in the row's format (the script checks the bytes)."""
    script = load_script(monkeypatch)
    tiny = [a for a in TINY if a != "--host"]
    out = tmp_path / "quality.json"
    assert script.main(tiny + ["--rows", "ts-int8", "--steps", "2", "--eval-every", "2", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"]["ts-int8"]
    assert row["placement"] == "device" and row["moment_homes"] == ["gpu"]
    assert row["gpu_updated_blocks"] == row["blocks"]


def test_missing_package_fails_its_row_and_rows_merge_into_the_file(tmp_path, monkeypatch, capsys):
    script = load_script(monkeypatch)
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    out = tmp_path / "quality.json"
    out.write_text(json.dumps({"rows": {"ts-bf16": {"name": "ts-bf16", "final_eval_loss": 5.0}}}))
    code = script.main(TINY + ["--rows", "torchao-8bit,torch-fp32", "--steps", "2", "--eval-every", "1",
                               "--json", str(out)])
    assert code == 1
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"ts-bf16", "torchao-8bit", "torch-fp32"}  # the earlier run's row kept
    assert "torchao" in rows["torchao-8bit"]["error"] and rows["torch-fp32"]["error"] is None
    assert len(rows["torch-fp32"]["eval"]) == 3  # the start, then each of the two steps
    assert "ts-bf16" in capsys.readouterr().out  # the table covers the whole file


def test_unknown_row_is_refused_naming_the_valid_ones(monkeypatch, capsys):
    script = load_script(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--rows", "ts-fp32,adam-4bit"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "adam-4bit" in err
    assert all(name in err for name in ("ts-fp32", "ts-bf16", "ts-int8", "torch-fp32", "bnb-8bit", "torchao-8bit"))


def test_plot_only_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    script = load_script(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "quality.json"
    out.write_text(json.dumps({"rows": {"ts-fp32": {"name": "ts-fp32", "final_eval_loss": 5.0, "train_loss": [5.5],
                                                    "eval": [[1, 5.0]]}}}))
    assert script.main(["--plot-only", "--json", str(out), "--plot", str(tmp_path / "q.png")]) == 1
    assert "matplotlib is not installed" in capsys.readouterr().err
