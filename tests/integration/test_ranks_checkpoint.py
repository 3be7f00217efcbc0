"""Checkpoints of several processes over gloo on the CPU (issue 42): one checkpoint written by every rank (each its
blocks' files, rank 0 publishing), loaded at any number of ranks or in one process; a rank failing mid-save publishes
nothing and fails every rank ([Note: checkpoints of several processes] in runtime.checkpoint.ranks)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.checkpoint.files import MANIFEST_NAME, read_manifest, verify_checkpoint
from tests.integration import test_ranks
from tests.integration.test_ranks import assert_nearly_equal, finish

CHILD = Path(__file__).with_name("ranks_checkpoint_child.py")
# RANKS_TEST_DEVICE=cuda runs the same tests over NCCL, one GPU per rank (the 3-rank test needs 3 GPUs).
CONFIG = {"device": os.environ.get("RANKS_TEST_DEVICE", "cpu"), "dtype": "fp32", "optimizer": {"lr": 1e-3}}


def start(out: Path, world: int, plan: dict[str, Any],
          extra_env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start ``ranks_checkpoint_child.py`` as ``world`` ranks (one process when 1), as torchrun would: test_ranks'
    launcher, given this child and the plan in place of a config."""
    out.mkdir(parents=True, exist_ok=True)
    return test_ranks.start(out, world, {"config": CONFIG, **plan}, extra_env=extra_env, child=CHILD)


def launch(out: Path, world: int, plan: dict[str, Any],
           timeout_s: float = 180.0) -> list[dict[str, Any]]:
    """Run the plan at ``world`` ranks; each rank's record."""
    procs = start(out, world, plan)
    outputs = finish(procs, timeout_s)
    for rank, (proc, text) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} of {world} exited with {proc.returncode}:\n{text[-4000:]}"
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]


def block_files(records: list[dict[str, Any]]) -> set[str]:
    """The tensor files of a checkpoint of the ranks whose ``records`` are given: one per state key any rank keeps."""
    keys = set().union(*(record["keys"] for record in records))
    return {f"{key}.bin" for key in keys if key.rsplit(".", 1)[-1] in ("master", "exp_avg", "exp_avg_sq")}


def assert_one_checkpoint(root: Path, step: int, records: list[dict[str, Any]]) -> Path:
    """``root`` holds exactly the checkpoint of ``step``, complete (every block's files once, nothing unlisted),
    and no scratch directory."""
    path = root / f"step-{step:06d}"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".tierstore")) == ["latest", path.name]
    listed = set(read_manifest(path))
    assert {p.name for p in path.iterdir()} == listed | {MANIFEST_NAME}
    assert {name for name in listed if name.startswith("block")} == block_files(records)
    verify_checkpoint(path)
    return path


def test_a_checkpoint_of_two_ranks_resumes_in_one_process_and_back(tmp_path):
    """Saved at 2 ranks after 2 steps, loaded in one process, 2 more steps: the weights of 4 steps at 2 ranks. That
    process's checkpoint loads at 2 ranks exactly (weights and optimizer state), whose state_dict round-trips."""
    two = launch(tmp_path / "two", 2, {"train": 2, "save": str(tmp_path / "a"), "more": 2})
    assert two[0]["saved"] == two[1]["saved"] == str(tmp_path / "a" / "step-000002")
    path = assert_one_checkpoint(tmp_path / "a", 2, two)
    meta = json.loads((path / "meta.json").read_text())
    assert [entry["data"]["position"] for entry in meta["ranks"]] == [2, 2]  # each rank's data state, rank 0's first
    assert meta["ranks"][0] == {"rng": meta["rng"], "data": meta["data"]}
    assert meta["ranks"][1]["data"]["generator"] == "data.generator.rank1.bin"
    kept = [set(record["keys"]) for record in two]
    assert kept[0] and kept[1] and not kept[0] & kept[1]  # each rank wrote its own blocks' files

    [one] = launch(tmp_path / "one", 1, {"load": str(tmp_path / "a"), "train": 2, "save": str(tmp_path / "b"),
                                        "optimizer_round_trip": True})
    assert one["loaded_step"] == 2
    for name, value in two[0]["weights"].items():
        assert_nearly_equal(one["weights"][name], value, f"one process resumed at step 2, {name}")
    assert_one_checkpoint(tmp_path / "b", 4, [one])

    back = launch(tmp_path / "back", 2, {"load": str(tmp_path / "b"), "optimizer_round_trip": True})
    for rank, record in enumerate(back):
        assert record["loaded_step"] == 4
        for name, value in one["weights"].items():
            assert torch.equal(record["weights"][name], value), f"rank {rank}: {name} differs from the saved one"
        moments = record["optimizer"]
        assert moments["original"].keys() == one["optimizer"]["original"].keys()
        for index, entry in one["optimizer"]["original"].items():
            for kind, value in entry.items():
                assert torch.equal(moments["original"][index][kind], value), f"rank {rank}: {kind} of parameter {index}"
                assert torch.equal(moments["restored"][index][kind], value)
                doubled = value * 2 if kind == "exp_avg" else value
                assert torch.equal(moments["doubled"][index][kind], doubled), f"rank {rank}: loaded {kind} of {index}"


@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_resumes_at_three(tmp_path, tmpfs_dir):
    """Saved at 2 ranks with every state in host memory, loaded at 3 with the moments in swap files (each rank's
    own): 2 more steps give the weights of 4 steps at 2 ranks."""
    two = launch(tmp_path / "two", 2, {"train": 2, "save": str(tmp_path / "a"), "more": 2})
    spilled = {**CONFIG, "placement": {"moments": "nvme"}, "tiers": {"nvme": {"path": str(tmpfs_dir)}}}
    three = launch(tmp_path / "three", 3, {"load": str(tmp_path / "a"), "train": 2, "config": spilled})
    for rank, record in enumerate(three):
        assert record["loaded_step"] == 2
        assert {home for key, home in record["homes"].items() if key.endswith(".exp_avg")} == {"NVME"}
        for name, value in two[0]["weights"].items():
            assert_nearly_equal(record["weights"][name], value, f"rank {rank} of 3 resumed at step 2, {name}")


@pytest.mark.slow
def test_each_rank_resumes_its_own_data_stream_at_as_many_ranks(tmp_path):
    """Each rank draws from its own data stream: resumed at 2 ranks, each continues its own (a rank given rank 0's
    stream would train on other batches: the weights would differ by whole lr steps)."""
    plan = {"per_rank_data": True}
    two = launch(tmp_path / "two", 2, {**plan, "train": 2, "save": str(tmp_path / "a"), "more": 2})
    resumed = launch(tmp_path / "resumed", 2, {**plan, "load": str(tmp_path / "a"), "train": 2})
    for rank, record in enumerate(resumed):
        for name, value in two[0]["weights"].items():
            assert_nearly_equal(record["weights"][name], value, f"rank {rank} resumed at step 2, {name}")


@pytest.mark.parametrize("how", ["raise", pytest.param("kill", marks=pytest.mark.slow)])
def test_a_rank_failing_mid_save_publishes_nothing_and_fails_every_rank(tmp_path, how):
    """Rank 1 fails after writing its first file: no checkpoint, no scratch directory, an error on every rank (rank 0
    naming rank 1's failure; after a kill, rank 0's exchange times out)."""
    root = tmp_path / "root"
    procs = start(tmp_path / "out", 2, {"train": 1, "save": str(root), "fail_save": f"1:{how}"},
                  extra_env={"TIERSTORE_COLLECTIVE_TIMEOUT_S": "15"})
    outputs = finish(procs, timeout_s=120)
    assert all(proc.returncode not in (0, None) for proc in procs), outputs
    if how == "raise":
        assert "test failure on rank 1" in outputs[1], outputs[1][-3000:]
        assert "saving a checkpoint failed on rank 1" in outputs[0] and "test failure on rank 1" in outputs[0], outputs[0][-3000:]
    else:
        assert "rank 0 of 2" in outputs[0] and "failed" in outputs[0], outputs[0][-3000:]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".tierstore")) == []


@pytest.mark.slow
def test_a_file_of_one_rank_failing_its_hash_fails_the_load_on_every_rank(tmp_path):
    """A block file of rank 1's corrupted after the save: rank 1 refuses it as it reads it, rank 0 (which loaded its
    blocks) raises too, and both refuse to train until a load completes."""
    two = launch(tmp_path / "two", 2, {"train": 2, "save": str(tmp_path / "a")})
    name = f"{sorted(key for key in two[1]['keys'] if key.endswith('.master'))[0]}.bin"
    target = Path(two[1]["saved"]) / name
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    target.write_bytes(bytes(raw))
    procs = start(tmp_path / "load", 2, {"load": str(tmp_path / "a")})
    outputs = finish(procs, timeout_s=120)
    assert all(proc.returncode == 3 for proc in procs), outputs
    records = [torch.load(tmp_path / "load" / f"rank{rank}.pt") for rank in range(2)]
    assert records[1]["error"].startswith("DamagedCheckpointError") and name in records[1]["error"]
    assert records[0]["error"].startswith("DamagedCheckpointError"), records[0]["error"]
    assert "failed on rank 1" in records[0]["error"] and name in records[0]["error"]
    for record in records:
        assert "a checkpoint load was cut short" in record["train_error"], record
