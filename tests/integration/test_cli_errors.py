"""Every error a user can cause ends the CLI with one clear message and a non-zero status, never a traceback.

Most cases run the CLI in this process with the failure planted (a CUDA OOM can only be raised by hand on
the CPU); the corrupt swap file runs as a real process, so that what the optimizer worker logs from its
thread is seen as a user sees it.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from runtime.bench.train_bench import failure_reason
from runtime.cli.main import main as cli_main

REPO = Path(__file__).resolve().parents[2]
MODEL = {"vocab_size": 256, "hidden_size": 32, "num_layers": 3, "num_heads": 4, "ffn_size": 64, "max_seq_len": 64}


def config_file(tmp_path: Path, swap: Path | None = None, steps: int = 3) -> Path:
    """The tiny model on the CPU; master and moments in swap files under ``swap`` when given."""
    config = {"dtype": "fp32", "device": "cpu", "optimizer": {"grad_clip": None},
              "train": {"steps": steps, "batch_size": 2, "seq_len": 32, "log_every": 1, "model": MODEL}}
    if swap is not None:
        swap.mkdir(exist_ok=True)
        config["placement"] = {"master": "nvme", "moments": "nvme"}
        config["tiers"] = {"nvme": {"path": str(swap)}}
    path = tmp_path / "tiers.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_a_corrupt_swap_file_read_by_the_optimizer_worker(tmp_path):
    # The 20th swap read (a few steps in, on the worker's thread) first flips one payload byte on disk.
    driver = textwrap.dedent("""
        import os, sys
        from tierstore import nvme
        original, calls = nvme.NVMeDirectory.read, []
        def read(self, swap, dst, *rest):
            calls.append(swap.path)
            if len(calls) == 20:
                fd = os.open(swap.path, os.O_RDWR)
                os.pwrite(fd, bytes([os.pread(fd, 1, nvme.HEADER_NBYTES + 8)[0] ^ 0xFF]), nvme.HEADER_NBYTES + 8)
                os.close(fd)
            return original(self, swap, dst, *rest)
        nvme.NVMeDirectory.read = read
        from runtime.cli.main import main
        sys.exit(main(sys.argv[1:]))
    """)
    swap = tmp_path / "swap"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", driver, "train", "--config", str(config_file(tmp_path, swap, steps=20))],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tierstore: error: swap file {swap}/") and "is corrupt: payload checksum" in last, proc.stderr
    assert "--resume" in last  # what to do about it
    assert "Traceback" not in proc.stderr, proc.stderr
    assert sorted(p.name for p in swap.iterdir() if p.suffix == ".tsw") == []  # closed on the way out


def test_cuda_out_of_memory(tmp_path, capsys, monkeypatch):
    from runtime.bundled.example_model import ExampleLM

    def forward(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.10 GiB total)")

    monkeypatch.setattr(ExampleLM, "forward", forward)
    assert cli_main(["train", "--config", str(config_file(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "tierstore: error: the GPU ran out of memory (CUDA out of memory. Tried to allocate 20.00 GiB" in err
    assert "train.batch_size" in err and "Traceback" not in err


@pytest.mark.parametrize("code,message", [(errno.EACCES, "permission denied writing or reading {target}"),
                                          (errno.EROFS, "{target} is on a read-only file system")])
def test_a_checkpoint_directory_that_cannot_be_written(code, message, tmp_path, capsys, monkeypatch):
    # Creating the checkpoint root fails as it would under a directory of another user (this test may run as
    # root, which permissions do not stop) or on a read-only mount. A save that fails later warns and goes on.
    target = tmp_path / "ckpt"

    def make_dirs(path):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr("runtime.checkpoint.root._make_private_dirs", make_dirs)
    assert cli_main(["train", "--config", str(config_file(tmp_path)), "--checkpoint-dir", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "tierstore: error: " + message.format(target=target) in err
    assert "--checkpoint-dir" in err and "chmod" not in err and "Traceback" not in err


def test_a_swap_directory_on_a_read_only_file_system(tmp_path, capsys, monkeypatch):
    swap = tmp_path / "swap"
    real_statvfs = os.statvfs

    def statvfs(path):
        result = real_statvfs(path)
        if Path(path) != swap:
            return result
        return os.statvfs_result((*result[:8], result.f_flag | os.ST_RDONLY, result.f_namemax))

    monkeypatch.setattr(os, "statvfs", statvfs)
    for command in ("plan", "train"):
        assert cli_main([command, "--config", str(config_file(tmp_path, swap))]) == 2
        err = capsys.readouterr().err
        assert "is on a read-only file system; pick a directory on a writable one" in err
        assert "chmod" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_bench_train_without_cuda(capsys):
    assert cli_main(["bench", "train", "--preset", "tiny", "--rows", "torch"]) == 2
    err = capsys.readouterr().err
    assert "tierstore: error: tierstore bench train times training on a GPU" in err and "no CUDA device" in err


def test_a_failed_bench_row_says_why():
    stderr = ('INFO x: running\nTraceback (most recent call last):\n  File "a.py", line 1\n'
              "AssertionError: Torch not compiled with CUDA enabled\n")
    assert failure_reason(stderr) == "AssertionError: Torch not compiled with CUDA enabled"
    assert failure_reason("tierstore: error: the memory plan does not fit:\n  host: ...\n  state tier bytes\n") \
        == "tierstore: error: the memory plan does not fit:"
    assert failure_reason("") == "failed without a message"


def test_resume_of_a_finished_run_says_it_is_complete(tmp_path, capsys):
    config, ckpt = config_file(tmp_path, steps=2), tmp_path / "ckpt"
    assert cli_main(["train", "--config", str(config), "--checkpoint-dir", str(ckpt)]) == 0
    capsys.readouterr()
    assert cli_main(["train", "--config", str(config), "--checkpoint-dir", str(ckpt), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "is already complete at step 2 (train.steps is 2); nothing to train" in err
    assert "nan" not in err and "done:" not in err


@pytest.mark.parametrize("args, said", [
    (["bench", "store", "--transfer", "0"], "--transfer: '0': give a size above zero"),
    (["bench", "store", "--transfer", "1000"], "a whole number of 4 KiB pages"),
    (["bench", "store", "--total", "0"], "--total: '0': give a size above zero"),
    (["bench", "store", "--repeats", "0"], "--repeats: 0: give 1 or more"),
    (["bench", "store", "--io-threads", "0"], "--io-threads: 0: give 1 or more"),
    (["train", "--checkpoint-dir", ""], "--checkpoint-dir: an empty path"),
    (["train", "--profile", ""], "--profile: an empty path"),
])
def test_a_bad_command_line_value_is_refused_by_its_flag(capsys, args, said):
    """Found by a helper: --transfer 0 divided by zero (a traceback), --repeats 0 said 'min() arg is an empty
    sequence', a transfer that is no whole page made a swap file per kilobyte until EMFILE, and an empty path was
    the current directory (a run wrote its checkpoints there)."""
    with pytest.raises(SystemExit) as info:
        cli_main(args)
    assert info.value.code == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("content, said", [("", "not JSON"), ("{}", "no totals, steps, duration_s")])
def test_a_profile_directory_whose_summary_is_no_profile_s_is_refused_naming_the_file(tmp_path, capsys, content, said):
    """`tierstore profile DIR` on a summary.json that is empty or not a profile's: a KeyError traceback, or a bare
    JSON message naming no file (found by a helper)."""
    (tmp_path / "summary.json").write_text(content)
    assert cli_main(["profile", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'summary.json'} is not a profile's summary ({said}" in err and "Traceback" not in err


@pytest.mark.slow
def test_sigterm_during_bench_store_removes_its_swap_files(tmp_path):
    """SIGTERM (a scheduler, `timeout`) killed `tierstore bench store` without its cleanup: up to 1.1 GB of swap
    files left (found by a helper). It now ends like `tierstore train`: status 143, nothing left."""
    import signal
    import time

    disk = tmp_path / "disk"
    disk.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli.main", "bench", "store", "--nvme-dir", str(disk),
                             "--total", "256MiB", "--repeats", "50"], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not any(disk.rglob("*.tsw")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # polls the file: another process's write has no event this one can wait on
    assert any(disk.rglob("*.tsw")), "the bench never wrote a swap file (else this test proves nothing)"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "terminated by SIGTERM: stopped, its swap files removed" in err
    assert list(disk.rglob("*.tsw")) == [], err


def test_a_checkpoint_directory_that_cannot_be_made_is_refused_naming_the_flag(tmp_path, capsys):
    """It printed a bare `[Errno 2] No such file or directory: '/proc/...'` (found by a helper)."""
    (tmp_path / "a_file").write_text("")
    target = tmp_path / "a_file" / "ckpt"  # a directory under a file: never creatable
    assert cli_main(["train", "--config", str(config_file(tmp_path)), "--checkpoint-dir", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint directory {target} cannot be made" in err and "--checkpoint-dir" in err
