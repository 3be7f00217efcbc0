"""Exact resume: stop at a step, resume from the checkpoint, run to the end; the losses after resume equal an
uninterrupted run's bit for bit (fp32, CPU), also when the new session puts the state on other tiers."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from runtime.bundled.data import stdlib_text_bytes
from runtime.checkpoint.root import LOCK_NAME
from runtime.cli.main import main as cli_main
from tests.integration.checkpoint_training import tiny_cli_config, tiny_config, train

TOTAL = 7


@pytest.fixture(scope="module")
def corpus() -> bytes:
    return stdlib_text_bytes(1 << 20)


@pytest.fixture(scope="module")
def uninterrupted(corpus: bytes, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    swap = tmp_path_factory.mktemp("swap-reference")
    return train(tiny_config(swap, moments="nvme"), corpus, TOTAL)


def crash_and_resume(corpus: bytes, tmp_path: Path, stop: int, before: dict, after: dict, save_every: int = 1) -> dict[int, float]:
    """Train to ``stop`` saving every step under ``before``'s layout, drop that session, resume under ``after``'s."""
    ckpt = tmp_path / "ckpt"
    (tmp_path / "swap-a").mkdir()
    (tmp_path / "swap-b").mkdir()
    first = train(tiny_config(tmp_path / "swap-a", **before), corpus, TOTAL, checkpoint_dir=ckpt, save_every=save_every,
                  stop_after=stop)
    resumed_at: list[int] = []
    second = train(tiny_config(tmp_path / "swap-b", **after), corpus, TOTAL, checkpoint_dir=ckpt, resume=True,
                   on_resume=resumed_at.append)
    assert resumed_at == [stop - stop % save_every]
    assert set(second) == set(range(resumed_at[0] + 1, TOTAL + 1))
    return {**first, **second}


@pytest.mark.parametrize("stop", [1, 3, 6])
def test_resume_at_several_steps_is_bit_identical(corpus, tmp_path, uninterrupted, stop):
    layout = {"moments": "nvme"}
    assert crash_and_resume(corpus, tmp_path, stop, layout, layout) == uninterrupted


@pytest.mark.parametrize("before, after", [
    ({"moments": "host"}, {"moments": "nvme"}),  # moments were in host memory, now in swap files
    ({"moments": "nvme"}, {"moments": "host"}),
    ({"master": "host", "moments": "host"}, {"master": "nvme", "moments": "nvme"}),  # weights from a host copy now
    ({"moments": "nvme", "optimizer__gpu_update_fraction": 0.5}, {"moments": "host"}),  # device-updated blocks
    ({"master": "nvme", "moments": "nvme"}, {"moments": "host", "optimizer__gpu_update_fraction": 0.5}),
], ids=["host-to-nvme", "nvme-to-host", "all-to-nvme", "gpu-to-host", "nvme-to-gpu"])
def test_resume_into_another_layout_is_bit_identical(corpus, tmp_path, uninterrupted, before, after):
    assert crash_and_resume(corpus, tmp_path, 3, before, after) == uninterrupted


def test_resume_from_an_older_checkpoint_keeps_every_save_count(corpus, tmp_path, uninterrupted):
    """save_every 2, stopped at 5: the last checkpoint is step 4, and step 5 runs again after resume."""
    layout = {"moments": "nvme"}
    assert crash_and_resume(corpus, tmp_path, 5, layout, layout, save_every=2) == uninterrupted


def test_fp16_loss_scaler_resumes_exactly(corpus, tmp_path):
    """fp16 compute with dynamic loss scaling: scale and growth tracker come back with the rest."""
    def config(swap: Path) -> dict:
        return tiny_config(swap, moments="nvme", dtype="fp16",
                           optimizer={"grad_clip": None, "loss_scale": {"initial": 2.0**14, "growth_interval": 2}})
    for name in ("ref", "a", "b"):
        (tmp_path / name).mkdir()
    reference = train(config(tmp_path / "ref"), corpus, 6)
    first = train(config(tmp_path / "a"), corpus, 6, checkpoint_dir=tmp_path / "ckpt", save_every=3, stop_after=3)
    meta = json.loads((tmp_path / "ckpt" / "step-000003" / "meta.json").read_text())
    assert meta["scaler"]["scale"] != 2.0**14 or meta["scaler"]["growth_tracker"] != 0  # the scaler moved
    second = train(config(tmp_path / "b"), corpus, 6, checkpoint_dir=tmp_path / "ckpt", resume=True)
    assert {**first, **second} == reference


@pytest.mark.gpu
@pytest.mark.parametrize("after", [{"moments": "nvme", "optimizer__gpu_update_fraction": 0.3},
                                   {"moments": "host", "placement__weights": "gpu", "optimizer__gpu_update_fraction": 0.0,
                                    "optimizer__gpu_stream_fraction": 0.0}], ids=["same", "resident-weights"])
def test_resume_on_the_gpu_is_bit_identical(corpus, tmp_path, after):
    """bf16 compute on the GPU, part of the update on the device (GPU-home state), CUDA RNG restored."""
    cuda = {"device": "cuda", "dtype": "bf16"}
    before = {**cuda, "moments": "nvme", "optimizer__gpu_update_fraction": 0.3}
    (tmp_path / "swap-ref").mkdir()
    reference = train(tiny_config(tmp_path / "swap-ref", **before), corpus, TOTAL)
    assert crash_and_resume(corpus, tmp_path, 3, before, {**cuda, **after}) == reference


def block_digests(checkpoint: Path) -> dict[str, str]:
    files = json.loads((checkpoint / "manifest.json").read_text())["files"]
    return {name: entry["sha256"] for name, entry in files.items() if name.startswith("block")}


def test_cli_train_save_every_and_resume(tmp_path, capsys):
    """`tierstore train --checkpoint-dir D --save-every N [--resume]`: 4 steps, then resume to 6, ends in the
    same master and moments (same sha256) as 6 uninterrupted steps."""
    config = tiny_cli_config(tmp_path)
    interrupted, straight = tmp_path / "ckpt-a", tmp_path / "ckpt-b"
    base = ["train", "--config", str(config)]
    assert cli_main(base + ["--steps", "4", "--checkpoint-dir", str(interrupted), "--save-every", "2"]) == 0
    assert (interrupted / "latest").read_text().strip() == "step-000004"
    assert cli_main(base + ["--steps", "6", "--checkpoint-dir", str(interrupted), "--save-every", "2", "--resume"]) == 0
    assert cli_main(base + ["--steps", "6", "--checkpoint-dir", str(straight)]) == 0  # save_every 0: at the end only
    assert sorted(p.name for p in straight.iterdir() if p.name != LOCK_NAME) == ["latest", "step-000006"]
    assert sorted(p.name for p in interrupted.iterdir() if p.name != LOCK_NAME) == ["latest", "step-000002", "step-000004", "step-000006"]
    assert block_digests(interrupted / "step-000006") == block_digests(straight / "step-000006")
    capsys.readouterr()


def test_cli_resume_restores_the_lr_schedule(tmp_path, capsys):
    """`train.lr_schedule: cosine` with warm-up: resuming from step 4 of a 6-step run ends bit-identical to the
    uninterrupted run; without the scheduler's state the warm-up would start over and the weights would differ."""
    config = tiny_cli_config(tmp_path, "  lr_schedule: cosine\n  warmup_steps: 3\n")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    base = ["train", "--config", str(config), "--steps", "6", "--save-every", "2"]
    assert cli_main(base + ["--checkpoint-dir", str(straight)]) == 0
    resumed.mkdir()
    shutil.copytree(straight / "step-000004", resumed / "step-000004")
    (resumed / "latest").write_text("step-000004\n")
    assert cli_main(base + ["--checkpoint-dir", str(resumed), "--resume"]) == 0
    meta = json.loads((resumed / "step-000006" / "meta.json").read_text())
    assert meta["scheduler"]["last_epoch"] == 6 and meta["param_groups"][0]["lr"] < meta["param_groups"][0]["initial_lr"]
    assert block_digests(resumed / "step-000006") == block_digests(straight / "step-000006")
    capsys.readouterr()


def test_cli_resume_into_an_empty_directory_names_it(tmp_path, capsys, caplog):
    """`--resume` where no checkpoint is yet: training starts at step 0 and the warning names the directory (it
    had printed the CheckpointRoot object's repr)."""
    empty = tmp_path / "fresh"
    with caplog.at_level(logging.WARNING, logger="runtime.checkpoint.state"):
        assert cli_main(["train", "--config", str(tiny_cli_config(tmp_path)), "--steps", "1",
                         "--checkpoint-dir", str(empty), "--resume"]) == 0
    assert f"no checkpoint in {empty} yet; starting from step 0" in caplog.text, caplog.text
    capsys.readouterr()


def test_cli_resume_needs_a_checkpoint_dir(tmp_path, capsys):
    assert cli_main(["train", "--steps", "1", "--resume"]) == 2
    assert "--resume needs --checkpoint-dir" in capsys.readouterr().err
