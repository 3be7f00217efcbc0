"""Loads that fail: a load cut short leaves the session refusing to train or save until a load completes; a
checkpoint that does not fit is refused before anything is restored; a changed optimizer setting that the
checkpoint's param_groups override is reported as not used; a damaged latest checkpoint at `tierstore train
--resume` is refused with the intact earlier ones and the command that resumes from one."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import runtime.checkpoint.state as checkpoint_module
from runtime import CheckpointError, load_checkpoint, offload, save_checkpoint
from runtime.bundled.data import ByteBatches
from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.cli.main import main as cli_main
from tests.integration.checkpoint_training import tiny_cli_config

SHAPE = ModelShape(vocab_size=256, hidden_size=16, num_layers=2, num_heads=2, ffn_size=32, max_seq_len=32)
CORPUS = bytes(range(256)) * 64


def make(swap: Path, *, lr: float = 1e-2, groups: bool = False) -> tuple[torch.nn.Module, Any]:
    """The tiny model offloaded on the CPU, moments in swap files; ``groups``: two param_groups (matrices, the rest)."""
    swap.mkdir(exist_ok=True)
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    param_groups = None
    if groups:
        params = list(model.parameters())
        param_groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    config = {"dtype": "fp32", "device": "cpu", "tiers": {"nvme": {"path": str(swap)}},
              "placement": {"master": "host", "moments": "nvme"}, "optimizer": {"grad_clip": None, "lr": lr}}
    return offload(model, config, param_groups=param_groups)


def train(model: torch.nn.Module, optimizer: Any, data: ByteBatches, steps: int) -> None:
    for _ in range(steps):
        model(*data.next()).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture
def checkpoint(tmp_path: Path) -> Iterator[Path]:
    """A checkpoint of step 2 (one param group, lr 0.01, no scheduler state)."""
    model, optimizer = make(tmp_path / "swap-saved")
    train(model, optimizer, ByteBatches(CORPUS, 2, 16, seed=0), 2)
    path = save_checkpoint(optimizer.session, tmp_path / "ckpt")
    optimizer.session.close()
    yield path


# ---- a load cut short ------------------------------------------------------------------------------
@pytest.mark.parametrize("cut", ["hash", "exception", "sigint"])
@pytest.mark.usefixtures("default_sigint")
def test_a_load_cut_short_refuses_training_and_saves_until_a_load_completes(checkpoint, tmp_path, monkeypatch, cut):
    """The 4th tensor file fails its hash, raises KeyboardInterrupt, or is cut by a real SIGINT: the session then
    holds some of the checkpoint's tensors and some of its own, so forward, step, state reads and saves refuse
    (before, training went on and the next save published the mix as latest). A complete load mends it."""
    model, optimizer = make(tmp_path / "swap")
    data = ByteBatches(CORPUS, 2, 16, seed=1)
    train(model, optimizer, data, 3)
    real_read, reads = checkpoint_module.read_verified_into, []

    def read(path: Path, dst: memoryview, entry: Any) -> None:
        reads.append(path.name)
        if len(reads) == 4:
            if cut == "hash":
                raise CheckpointError(f"{path}: sha256 mismatch (planted)")
            if cut == "exception":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)  # the session's handler raises it here: loads are not deferred
            time.sleep(5)  # not reached: the handler raises before it; the sleep bounds a wait for a lost signal
        real_read(path, dst, entry)

    monkeypatch.setattr(checkpoint_module, "read_verified_into", read)
    expected = (CheckpointError, r"sha256 mismatch \(planted\); this session now holds a mix") if cut == "hash" else \
        (KeyboardInterrupt, r"Ctrl-C while loading .*step-000002: this session now holds a mix")
    with pytest.raises(expected[0], match=expected[1]):
        load_checkpoint(optimizer.session, checkpoint)
    monkeypatch.setattr(checkpoint_module, "read_verified_into", real_read)
    refused = r"a checkpoint load was cut short .*3 of \d+ tensors loaded.*load a good checkpoint"
    with pytest.raises(RuntimeError, match=refused):
        model(*data.next()).backward()
    with pytest.raises(RuntimeError, match=refused):
        optimizer.session.master_state_dict()
    with pytest.raises(RuntimeError, match=refused):
        save_checkpoint(optimizer.session, tmp_path / "ckpt-after")
    assert not list((tmp_path / "ckpt-after").glob("step-*"))

    assert load_checkpoint(optimizer.session, checkpoint) == 2  # a complete load: training goes on
    assert optimizer.session.controller.interrupted is None
    train(model, optimizer, data, 1)
    assert save_checkpoint(optimizer.session, tmp_path / "ckpt-after").name == "step-000003"
    optimizer.session.close()


# ---- refused before anything is restored -----------------------------------------------------------
def test_another_number_of_param_groups_is_refused_before_anything_is_restored(checkpoint, tmp_path):
    """Saved with one group, loaded with two: refused saying what to pass, and the session is untouched (it had
    been refused only after every tensor was overwritten, and could train on as a mix)."""
    model, optimizer = make(tmp_path / "swap", groups=True)
    before = optimizer.session.master_state_dict()
    with pytest.raises(CheckpointError, match=r"pass the same param_groups to offload\(\) as the saving run: it had 1 "
                                              r"parameter group\(s\), this optimizer has 2"):
        load_checkpoint(optimizer.session, checkpoint)
    after = optimizer.session.master_state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert optimizer.session.controller.optimizer_step == 0 and optimizer.session.controller.interrupted is None
    optimizer.session.close()


def test_a_scheduler_without_saved_state_is_refused_before_anything_is_restored(checkpoint, tmp_path):
    model, optimizer = make(tmp_path / "swap")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    before = optimizer.session.master_state_dict()
    with pytest.raises(CheckpointError, match=r"holds no LR scheduler state .*load it without scheduler="):
        load_checkpoint(optimizer.session, checkpoint, scheduler=scheduler)
    after = optimizer.session.master_state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert optimizer.session.controller.optimizer_step == 0
    optimizer.session.close()


# ---- what a changed config does ----------------------------------------------------------------------
def test_a_changed_lr_in_the_config_is_reported_as_not_used(checkpoint, tmp_path, caplog):
    """The checkpoint's param_groups win, as in plain PyTorch; the warning had said the lr 'changed' to the
    config's value, which was never used."""
    model, optimizer = make(tmp_path / "swap", lr=1e-3)
    with caplog.at_level(logging.WARNING, logger="runtime.checkpoint.state"):
        load_checkpoint(optimizer.session, checkpoint)
    assert [group["lr"] for group in optimizer.param_groups] == [0.01]
    assert "optimizer.lr 0.001 in the config where the checkpoint's run had 0.01: 0.001 is not used" in caplog.text
    assert "restored with lr 0.01" in caplog.text and "set group['lr'] in optimizer.param_groups" in caplog.text
    assert "changed: 0.01 -> 0.001" not in caplog.text
    optimizer.session.close()


# ---- a damaged latest checkpoint at resume ----------------------------------------------------------
def flip_a_byte(step_dir: Path) -> None:
    target = step_dir / "block1.exp_avg.bin"
    content = bytearray(target.read_bytes())
    content[10] ^= 0xFF
    target.write_bytes(bytes(content))


@pytest.mark.parametrize("damage", ["flipped", "no-manifest"])
def test_cli_resume_from_a_damaged_latest_names_the_intact_ones_and_the_command(tmp_path, capsys, damage):
    """The refusal lists the intact earlier checkpoints and the command that resumes from the newest; nothing
    is skipped on its own (latest and the directories stay as they were); the command works."""
    ckpt = tmp_path / "ckpt"
    base = ["train", "--config", str(tiny_cli_config(tmp_path)), "--checkpoint-dir", str(ckpt), "--save-every", "2"]
    assert cli_main(base + ["--steps", "4"]) == 0
    flip_a_byte(ckpt / "step-000004") if damage == "flipped" else (ckpt / "step-000004" / "manifest.json").unlink()
    capsys.readouterr()
    assert cli_main(base + ["--steps", "5", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "step-000004" in err and "Intact earlier checkpoints there, newest first: step-000002." in err, err
    assert "close it and load" not in err
    command = err.split("`")[1]
    assert command == f"mv {ckpt}/step-000004 {ckpt}/damaged-step-000004 && echo step-000002 > {ckpt}/latest"
    assert (ckpt / "latest").read_text().strip() == "step-000004"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-000002", "step-000004"]
    subprocess.run(command, shell=True, check=True)
    assert cli_main(base + ["--steps", "5", "--resume"]) == 0
    assert (ckpt / "latest").read_text().strip() == "step-000005"
    capsys.readouterr()
