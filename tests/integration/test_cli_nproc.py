"""``tierstore train --nproc N``: the bundled example trained as N processes (torchrun's launcher, gloo on the CPU)
reports the losses one process reports at the same micro-batch, and what several processes cannot do yet is
refused before anything is built, naming the flag."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def tierstore(*args: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def losses(text: str) -> tuple[float, float]:
    found = re.search(r"done: loss (\d+\.\d+) -> (\d+\.\d+)", text)
    assert found, text[-3000:]
    return float(found.group(1)), float(found.group(2))


@pytest.mark.parametrize(("flags", "said"), [
    pytest.param(["--micro-batch", "3"], "--micro-batch 3 does not split between 2 processes", marks=pytest.mark.slow),
])
def test_what_several_processes_cannot_do_is_refused_naming_the_flag(tmp_path, flags, said):
    done = tierstore("train", "--nproc", "2", "--steps", "1", *flags)
    assert done.returncode != 0
    assert said in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_sigterm_to_the_launcher_ends_every_rank_and_leaves_no_swap_file(tmp_path, tmpfs_dir):
    """SIGTERM to `tierstore train --nproc 2` (a scheduler's): the launcher sends it on, each rank abandons its step
    and removes its swap files, and the command ends with 143."""
    import signal
    import time

    config = tmp_path / "tiers.yaml"
    config.write_text(f"tiers:\n  nvme:\n    path: {tmpfs_dir}\nplacement:\n  moments: nvme\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "train", "--nproc", "2", "--config", str(config),
                             "--steps", "100000", "--micro-batch", "2"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(tmpfs_dir.rglob("*.tsw")):
        time.sleep(0.2)  # both ranks' swap files exist: training is under way
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143, err[-3000:]
    assert not [p for p in tmpfs_dir.rglob("*") if p.is_file()], "swap files left"


@pytest.mark.slow
def test_two_processes_train_as_one_and_stop_and_resume_from_their_checkpoint_exactly(tmp_path):
    """--nproc 2 reports one process's losses at the same micro-batch; with --checkpoint-dir rank 0 claims the
    directory, both ranks save each checkpoint (one checkpoint of both ranks' blocks), and stopped at step 4 and
    resumed to 6 is the uninterrupted 6-step run's loss. The uninterrupted run writes a profile a rank
    (--profile DIR: DIR/rank0, DIR/rank1, each its own blocks' traffic), which `tierstore profile` reads; given DIR
    itself it names them."""
    ck = str(tmp_path / "ck")
    first = tierstore("train", "--nproc", "2", "--steps", "4", "--micro-batch", "4", "--checkpoint-dir", ck, "--save-every", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = tierstore("train", "--nproc", "2", "--steps", "6", "--micro-batch", "4", "--checkpoint-dir", ck,
                        "--save-every", "2", "--resume")
    profile = tmp_path / "profile"
    whole = tierstore("train", "--nproc", "2", "--steps", "6", "--micro-batch", "4", "--profile", str(profile))
    one = tierstore("train", "--steps", "6", "--micro-batch", "4")
    assert resumed.returncode == 0 and whole.returncode == 0, resumed.stderr[-3000:] + whole.stderr[-3000:]
    assert one.returncode == 0, one.stderr[-3000:]
    assert losses(resumed.stderr)[1] == losses(whole.stderr)[1]
    # two processes train as one at the same micro-batch: the mean of the halves' losses, bf16 compute
    assert "2 processes (2 sequences of each micro-batch each)" in whole.stderr
    assert whole.stderr.count("done: loss") == 1  # one report, rank 0's
    (first_one, last_one), (first_two, last_two) = losses(one.stderr), losses(whole.stderr)
    assert abs(first_two - first_one) <= 1e-3 and abs(last_two - last_one) <= 0.01 * last_one
    assert last_two < first_two - 0.5  # it trained
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("step-")) == \
        ["step-000002", "step-000004", "step-000006"]
    for rank in (0, 1):
        assert f"profile of rank {rank} written to {profile / f'rank{rank}'}" in whole.stderr, whole.stderr[-3000:]
        report = tierstore("profile", str(profile / f"rank{rank}"))
        assert report.returncode == 0 and "traffic per path" in report.stdout, report.stderr[-3000:]
        paths = json.loads((profile / f"rank{rank}" / "summary.json").read_text())["totals"]["paths"]
        assert sum(path["nbytes"] for path in paths.values()) > 0  # bytes moved through this rank's tiers
    whole_dir = tierstore("profile", str(profile))
    assert whole_dir.returncode != 0 and "holds one profile a process (rank0, rank1" in whole_dir.stderr


@pytest.mark.slow
def test_two_processes_fine_tune_a_local_model_and_write_output_as_one_process(tmp_path):
    """``--nproc 2 --model DIR --output OUT``: both ranks read each block from its owner and rank 0 writes OUT, which
    ``from_pretrained`` loads with the weights one process trains at the same micro-batch (fp32: up to the order
    of the mean over ranks), and the tokenizer beside them."""
    transformers = pytest.importorskip("transformers")
    from tests.unit.runtime.cli.hf_model_dir import TEXT, make_model_dir

    model_dir = make_model_dir(tmp_path / "model")
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    config = tmp_path / "fp32.yaml"
    config.write_text("device: cpu\ndtype: fp32\n")
    common = ["--model", str(model_dir), "--data", str(data), "--config", str(config), "--steps", "3", "--seq", "32",
              "--micro-batch", "4", "--lr", "1e-3"]
    two = tierstore("train", "--nproc", "2", *common, "--output", str(tmp_path / "two"))
    one = tierstore("train", *common, "--output", str(tmp_path / "one"))
    assert two.returncode == 0 and one.returncode == 0, two.stderr[-3000:] + one.stderr[-3000:]
    assert two.stderr.count("model and tokenizer written to") == 1  # rank 0's
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "two", local_files_only=True).state_dict()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one", local_files_only=True).state_dict()
    start = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert (ours[name] - value).abs().max() <= 5e-5, name  # 5% of one lr step
    assert any(not torch.equal(value, start[name]) for name, value in theirs.items())  # it trained
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "two", local_files_only=True)
    assert tokenizer("the lazy dog")["input_ids"]
