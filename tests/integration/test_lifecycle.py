"""How a training process ends, tried as a user would, each in its own process (the claims are about exit):

- a script that returns without ``session.close()`` exits 0, with no traceback and no swap file left, also
  while a thread it did not join still trains (that thread finishes first);
- SIGTERM (what schedulers and ``docker stop`` send) mid-training ends a script or ``tierstore train`` with a
  non-zero status and a message, no swap file left, and the latest checkpoint intact;
- after SIGKILL (nothing of the process runs) the next start reclaims what was left: the same swap
  directory (and resumes from the checkpoint), or the killed run's temporary one on /dev/shm.

The scripts are ``tests/integration/lifecycle_child.py`` and the real CLI.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from runtime.checkpoint.files import find_checkpoint, list_checkpoints, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]
LINE_TIMEOUT_S = 120.0
CONFIG = """\
dtype: fp32
device: cpu
tiers: {{nvme: {{path: {swap}}}}}
placement: {{master: nvme, moments: nvme}}
optimizer: {{grad_clip: null}}
train:
  steps: 100000
  batch_size: 2
  seq_len: 32
  log_every: 1
  keep_last: 2
  model: {{vocab_size: 256, hidden_size: 32, num_layers: 3, num_heads: 4, ffn_size: 64, max_seq_len: 64}}
"""


class Child:
    """A subprocess whose stdout and stderr lines are read as they come (stderr kept whole for the end)."""

    def __init__(self, args: list[str]):
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, text=True, bufsize=1,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, None), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr), daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: IO[str], keep: list[str] | None) -> None:
        for line in stream:
            if keep is not None:
                keep.append(line)
            self.lines.put(line.strip())
        self.lines.put(None)

    def wait_for(self, prefix: str) -> str:
        """The next line (stdout or stderr) that starts with or contains ``prefix``."""
        ends = 0
        while True:
            try:
                line = self.lines.get(timeout=LINE_TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} within {LINE_TIMEOUT_S:.0f} s; stderr:\n{self.text()}") from None
            if line is None:
                ends += 1
                if ends == 2:
                    raise AssertionError(f"the child exited ({self.proc.wait()}) before {prefix!r}; stderr:\n{self.text()}")
                continue
            if line.startswith(prefix) or prefix in line:
                return line

    def finish(self, sig: int | None = None) -> int:
        """Send ``sig`` (if any) and wait for the exit status."""
        if sig is not None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=LINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def text(self) -> str:
        """Everything the child wrote to stderr so far."""
        return "".join(self.stderr)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    """Children started by a test; any still running at its end is killed."""
    started: list[Child] = []
    yield started
    for child in started:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()


def start(children: list[Child], *args: str) -> Child:
    """Start a child process (``-m module args`` or a script) and keep it for cleanup."""
    child = Child(list(args))
    children.append(child)
    return child


def swap_files(directory: Path) -> list[str]:
    """Swap files in a directory (the lock file, which stays by design, is not one)."""
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tsw")) if directory.exists() else []


def config_file(tmp_path: Path, swap: Path) -> Path:
    """The CLI config of the tiny model with master and moments in swap files under ``swap``."""
    swap.mkdir(exist_ok=True)
    path = tmp_path / "tiers.yaml"
    path.write_text(CONFIG.format(swap=swap))
    return path


@pytest.mark.slow
def test_exit_without_close_leaves_nothing_and_the_next_start_reclaims_a_killed_runs_tmp_directory(children, tmp_path):
    # A run on the tmp swap path (RAM-backed /dev/shm), killed: nothing of it runs, its directory stays.
    killed = start(children, "-m", "tests.integration.lifecycle_child", "loop", "tmp")
    killed_dir = Path(killed.wait_for("SWAP").split()[1])
    killed.wait_for("STEP 2")
    assert killed.finish(signal.SIGKILL) == -signal.SIGKILL
    assert swap_files(killed_dir), "a SIGKILLed run should leave its swap files (else this test proves nothing)"

    # A script with two sessions (a given directory and tmp) that returns without closing either.
    given = tmp_path / "swap"
    given.mkdir()
    script = start(children, "-m", "tests.integration.lifecycle_child", "noclose", str(given), "tmp")
    tmp_dir = Path(script.wait_for("SWAP /").split()[1])
    tmp_dir = Path(script.wait_for("SWAP /").split()[1]) if tmp_dir == given else tmp_dir
    assert not killed_dir.exists()  # reclaimed when the tmp session started: no process held its lock
    script.wait_for("END")
    assert script.finish() == 0, script.text()
    assert "Traceback" not in script.text() and "Error" not in script.text(), script.text()
    assert swap_files(given) == []
    assert not tmp_dir.exists()


@pytest.mark.slow
def test_sigterm_ends_a_script_cleanly(children, tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    script = start(children, "-m", "tests.integration.lifecycle_child", "loop", str(swap))
    script.wait_for("STEP 3")
    assert swap_files(swap)
    code = script.finish(signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, (code, script.text())  # not -15: the handler ran and cleanup followed
    assert "SIGTERM" in script.text() and "Traceback" not in script.text(), script.text()
    assert swap_files(swap) == []


@pytest.mark.slow
def test_sigkill_then_a_restart_that_gets_sigterm_leaves_nothing_and_intact_checkpoints(children, tmp_path):
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    train = ["-m", "runtime.cli.main", "train", "--config", str(config_file(tmp_path, swap)), "--checkpoint-dir", str(ckpt),
             "--save-every", "1"]
    killed = start(children, *train)
    killed.wait_for("step 3/")
    assert killed.finish(signal.SIGKILL) == -signal.SIGKILL
    assert swap_files(swap), "a SIGKILLed run should leave its swap files (else this test proves nothing)"

    # The next start takes the same swap directory over, resumes, and is stopped the way schedulers do.
    run = start(children, *train, "--resume")
    run.wait_for("step 7/")
    code = run.finish(signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, (code, run.text())  # not -15: the handler ran and cleanup followed
    assert "terminated by SIGTERM" in run.text() and "Traceback" not in run.text(), run.text()
    assert swap_files(swap) == []
    latest = find_checkpoint(ckpt)
    assert latest is not None and len(list_checkpoints(ckpt)) == 2  # keep_last
    verify_checkpoint(latest)
    assert [p.name for p in ckpt.iterdir() if p.name.startswith(".")] == []  # a cut save left nothing; the lock file went at close


CUDA_SCRIPT = """
import torch
from runtime import offload
from runtime.bundled.example_model import ExampleLM, ModelShape
from tierstore import TierName
torch.manual_seed(0)
shape = ModelShape(vocab_size=256, hidden_size=256, num_layers=4, num_heads=4, ffn_size=512)
model, optimizer = offload(ExampleLM(shape), {"dtype": "bf16", "tiers": {"nvme": {"path": "tmp"}},
                                               "placement": {"moments": "nvme"}, "optimizer": {"grad_clip": CLIP}})
print("SWAP", optimizer.session.store.tiers[TierName.NVME].directory.path, flush=True)
for _ in range(3):
    tokens = torch.randint(0, 256, SIZE, device="cuda")
    model(tokens, tokens).backward()
    optimizer.step()
    optimizer.zero_grad()
print("END", flush=True)  # returns with updates, refreshes and write-backs possibly still in flight
"""
# With a clip that binds, host gradients wait on the device and leave at the commit ([Note: held gradients]): at
# the script's end their copies may be in flight too (16 x 256 tokens leave them the room).
CUDA_SCRIPT_CASES = {"no clip": ("None", "(4, 64)"), "held gradients": ("0.01", "(16, 256)")}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CUDA_SCRIPT_CASES))
def test_exit_without_close_on_cuda_never_aborts(case):
    """On an H100, 4 of 8 such scripts used to abort ('terminate called without an active exception', rc 134)."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    clip, size = CUDA_SCRIPT_CASES[case]
    script = CUDA_SCRIPT.replace("CLIP", clip).replace("SIZE", size)
    for attempt in range(8):
        proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, (attempt, proc.returncode, proc.stderr[-2000:])
        swap = Path(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("SWAP")))
        assert not swap.exists() or not list(swap.glob("*.tsw")), attempt


@pytest.mark.slow
def test_a_thread_still_training_when_the_script_returns_finishes_before_the_session_closes(children, tmp_path):
    """Python joins non-daemon threads after the threading exit hooks that close tierstore's objects: those hooks
    wait for the thread first (they had closed the session under it: a hang in wait_updated, or a KeyError)."""
    swap = tmp_path / "swap"
    swap.mkdir()
    child = start(children, "-m", "tests.integration.lifecycle_child", "thread", str(swap))
    child.wait_for("THREAD END")
    assert child.finish() == 0, child.text()
    assert "Traceback" not in child.text(), child.text()
    assert swap_files(swap) == []


@pytest.mark.slow
def test_a_process_pool_left_open_does_not_hold_the_exit(children, tmp_path):
    """The exit hooks wait only for the thread that drives the session, not for every non-daemon thread: a process
    pool's manager thread (non-daemon, stopped by its own exit hook, which runs after tierstore's) held the exit
    forever when they waited for all."""
    swap = tmp_path / "swap"
    swap.mkdir()
    child = start(children, "-m", "tests.integration.lifecycle_child", "pool", str(swap))
    child.wait_for("END")
    assert child.finish() == 0, child.text()
    assert swap_files(swap) == []


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["daemon", "worker"])
def test_a_session_driven_by_a_daemon_or_a_pool_s_thread_does_not_hold_the_exit(children, tmp_path, mode):
    """The exit hook waits for the driving thread only where Python would: not for a daemon thread (a serving loop),
    nor for a thread pool's worker, idle until its pool's own exit hook (which runs after tierstore's): both held
    the exit forever."""
    swap = tmp_path / "swap"
    swap.mkdir()
    child = start(children, "-m", "tests.integration.lifecycle_child", mode, str(swap))
    child.wait_for("END")
    assert child.finish() == 0 or mode == "daemon", child.text()  # a daemon killed mid-step at exit may complain
