"""A disk that fills during a checkpoint save does not lose the run: `tierstore train` warns, the previous
checkpoint stays `latest` (and verifies), training goes on and the next save tries again -- unless
train.stop_on_save_failure asks to stop. Faults: a real small tmpfs where this machine lets us mount one,
and ENOSPC injected into the checkpoint writer at chosen moments everywhere."""

from __future__ import annotations

import errno
import logging
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import runtime.checkpoint.files as checkpoint_io
from runtime.checkpoint.files import find_checkpoint, list_checkpoints, read_latest, verify_checkpoint
from runtime.checkpoint.root import LOCK_NAME
from runtime.cli.main import main as cli_main
from tests.integration.checkpoint_training import tiny_cli_config


def fail_writes(monkeypatch: pytest.MonkeyPatch, when: Callable[[Path], bool]) -> list[str]:
    """Make the checkpoint writer's writes raise ENOSPC for files where ``when(path)``; returns the list of
    files that failed."""
    failed: list[str] = []
    real = checkpoint_io._write_all

    def write_all(fd: int, data: memoryview, path: Path) -> None:
        if when(path):
            failed.append(f"{path.parent.name}/{path.name}")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(fd, data, path)

    monkeypatch.setattr(checkpoint_io, "_write_all", write_all)
    return failed


def in_save_of(*steps: int) -> Callable[[Path], bool]:
    names = tuple(f".tmp-step-{s:06d}-" for s in steps)
    return lambda path: path.parent.name.startswith(names)


def train(tmp_path: Path, ckpt: Path, steps: int, *extra: str) -> int:
    return cli_main(["train", "--config", str(tiny_cli_config(tmp_path)), "--steps", str(steps), "--checkpoint-dir", str(ckpt),
                     "--save-every", "1", *extra])


def assert_clean(ckpt: Path, latest: str) -> None:
    """latest names a complete, verifying checkpoint, and no partial save is left."""
    assert read_latest(ckpt) == latest and find_checkpoint(ckpt) == ckpt / latest
    verify_checkpoint(ckpt / latest)
    assert [p.name for p in ckpt.iterdir() if p.name.startswith(".") and p.name != LOCK_NAME] == []


def test_failed_saves_warn_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog, capsys):
    ckpt = tmp_path / "ckpt"
    failed = fail_writes(monkeypatch, in_save_of(2, 3))
    with caplog.at_level(logging.WARNING, logger="runtime.cli.train"):
        assert train(tmp_path, ckpt, 4) == 0
    assert failed and {f.split("/")[0][:17] for f in failed} == {".tmp-step-000002-", ".tmp-step-000003-"}
    warnings = [r.getMessage() for r in caplog.records if r.name == "runtime.cli.train"]
    assert len(warnings) == 2 and all("No space left on device" in w and "step-000001 stays the latest" in w for w in warnings)
    assert "training goes on" in warnings[0] and "stop_on_save_failure" in warnings[0]
    assert [s for s, _ in list_checkpoints(ckpt)] == [1, 4]  # the run reached step 4 and saved it
    assert_clean(ckpt, "step-000004")
    assert "2 checkpoint saves failed" in capsys.readouterr().err


def test_failed_last_save_keeps_the_previous_latest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    ckpt = tmp_path / "ckpt"
    fail_writes(monkeypatch, in_save_of(3))
    assert train(tmp_path, ckpt, 3) == 0
    assert_clean(ckpt, "step-000002")


def test_failure_while_repointing_latest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The new directory is in place but ``latest`` could not be rewritten: latest stays on the previous
    checkpoint; the complete directory stays too, as this run's own (pruned by keep_last like the others)."""
    ckpt = tmp_path / "ckpt"
    calls = []
    fail_writes(monkeypatch, lambda path: path.name == "latest.tmp" and (calls.append(path) or len(calls) == 2))
    assert train(tmp_path, ckpt, 3) == 0
    assert_clean(ckpt, "step-000003")
    assert [s for s, _ in list_checkpoints(ckpt)] == [1, 2, 3]


def test_stop_on_save_failure_stops_with_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    ckpt = tmp_path / "ckpt"
    fail_writes(monkeypatch, in_save_of(2))
    config = tiny_cli_config(tmp_path, "  stop_on_save_failure: true\n")
    assert cli_main(["train", "--config", str(config), "--steps", "4", "--checkpoint-dir", str(ckpt), "--save-every", "1"]) == 2
    err = capsys.readouterr().err
    assert "tierstore: error: checkpoint of step 2 failed" in err and "step-000001 stays the latest" in err
    assert "stop_on_save_failure is true" in err
    assert_clean(ckpt, "step-000001")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 700 KiB tmpfs: room for one checkpoint of the tiny model (~450 KiB), not two."""
    mount = tmp_path / "small"
    mount.mkdir(mode=0o700)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=700k,mode=0700", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or done.returncode}); the ENOSPC tests above cover it")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_disk_that_fills_during_a_save(tmp_path: Path, small_tmpfs: Path, caplog):
    ckpt = small_tmpfs / "ckpt"
    with caplog.at_level(logging.WARNING, logger="runtime.cli.train"):
        assert train(tmp_path, ckpt, 3) == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "runtime.cli.train"]
    assert len(warnings) == 2 and all("No space left on device" in w or "ENOSPC" in w for w in warnings), warnings
    assert_clean(ckpt, "step-000001")
