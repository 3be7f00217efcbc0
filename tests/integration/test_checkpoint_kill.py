"""Crash safety: SIGKILL a training process at random moments inside a checkpoint save, over and over.

A fork server (tests/integration/checkpoint_kill_child.py) runs children that resume from the latest
checkpoint, train the tiny model with master and moments in swap files, and save every step with a short
sleep after each file so that random kill times land inside the save. After every kill:

- ``latest`` names a complete checkpoint -- the previous one, or the new one if the kill came after the
  pointer was replaced -- never a partial directory, and every file matches the manifest's sha256;
- the next child loads it (a real ``load_checkpoint``) and goes on.

At the end the losses of the whole crash-ridden run equal those of an uninterrupted run, bit for bit.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from runtime.checkpoint.files import find_checkpoint, list_checkpoints, parse_step_dir, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 26  # children killed at a random moment of a save; at least 20 must land before it is published
TOTAL = 90  # steps; each killed child makes at most 3, so only the final child reaches the end
LINE_TIMEOUT_S = 120.0


class Launcher:
    """The fork server, and a thread turning its stdout into a queue of (arrival time, line)."""

    def __init__(self, stderr: IO[bytes]):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration.checkpoint_kill_child"], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1)
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.child: int | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((time.perf_counter(), line.strip()))
        self.lines.put((time.perf_counter(), "EOF"))

    def next(self) -> tuple[float, list[str]]:
        try:
            at, line = self.lines.get(timeout=LINE_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"no output from the fork server for {LINE_TIMEOUT_S:.0f} s") from None
        if line == "EOF":
            raise AssertionError(f"the fork server exited (code {self.proc.poll()}); see its stderr log")
        return at, line.split()

    def start(self, **command: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.child is not None:
            _kill(self.child)
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    with open(tmp_path / "fork-server.stderr", "wb") as stderr:
        server = Launcher(stderr)
        try:
            _, words = server.next()
            assert words == ["READY"], words
            yield server
        finally:
            server.close()


def run_child(server: Launcher, losses: dict[int, float], kill_at_save: int | None = None,
              kill_window_s: float = 0.0, rng: random.Random | None = None, **command: object) -> dict[str, object]:
    """Start one child and follow it to its end; with ``kill_at_save``, SIGKILL it a random time into its
    n-th save. Returns what happened: resumed step, saved steps, save durations, the step being saved when
    killed, and the wait status."""
    server.start(**command)
    seen: dict[str, object] = {"resumed": None, "saved": [], "durations": [], "killed_during": None}
    saves = 0
    save_started = 0.0
    while True:
        at, words = server.next()
        kind = words[0]
        if kind == "PID":
            server.child = int(words[1])
        elif kind == "RESUMED":
            seen["resumed"] = int(words[1])
        elif kind == "LOSS":
            losses[int(words[1])] = float(words[2])
        elif kind == "SAVING":
            saves += 1
            save_started = at
            if saves == kill_at_save:
                assert rng is not None and server.child is not None
                time.sleep(rng.uniform(0.0, kill_window_s))  # the kill's random moment inside the save is the test
                _kill(server.child)
                seen["killed_during"] = int(words[1])
        elif kind == "SAVED":
            seen["saved"].append(int(words[1]))  # type: ignore[union-attr]
            seen["durations"].append(at - save_started)  # type: ignore[union-attr]
        elif kind == "EXIT":
            server.child = None
            seen["status"] = int(words[2])
            return seen


@pytest.mark.slow
def test_sigkill_inside_saves_never_loses_a_checkpoint(launcher, tmp_path):
    rng = random.Random(20240611)
    ckpt = tmp_path / "ckpt"
    reference: dict[int, float] = {}
    done = run_child(launcher, reference, swap=str(tmp_path / "swap-ref"), ckpt=None, total=TOTAL)
    assert done["status"] == 0 and sorted(reference) == list(range(1, TOTAL + 1))

    losses: dict[int, float] = {}
    # Calibration child: two whole saves (their duration sizes the kill window), killed in the third.
    first = run_child(launcher, losses, swap=str(tmp_path / "swap-0"), ckpt=str(ckpt), total=TOTAL, resume=False,
                      file_delay_s=0.002, kill_at_save=3, kill_window_s=0.02, rng=rng)
    window = min(first["durations"])  # type: ignore[type-var]
    latest_step = check_after_kill(ckpt, first)
    inside = 0
    for round_ in range(1, ROUNDS + 1):
        seen = run_child(launcher, losses, swap=str(tmp_path / f"swap-{round_}"), ckpt=str(ckpt), total=TOTAL,
                         resume=True, file_delay_s=0.002, kill_at_save=rng.randint(1, 3), kill_window_s=window, rng=rng)
        assert seen["resumed"] == latest_step, f"round {round_}: resumed at {seen['resumed']}, latest was {latest_step}"
        latest_step = check_after_kill(ckpt, seen)
        inside += latest_step != seen["killed_during"]  # the kill came before the new checkpoint was published
    assert inside >= 20, f"only {inside} of {ROUNDS} kills landed inside a save (window {window * 1e3:.1f} ms)"

    final = run_child(launcher, losses, swap=str(tmp_path / "swap-final"), ckpt=str(ckpt), total=TOTAL, resume=True)
    assert final["status"] == 0 and final["resumed"] == latest_step
    assert losses == reference  # after all those crashes, the same run, bit for bit
    assert [p.name for p in ckpt.iterdir() if p.name.startswith(".")] == []  # killed saves cleared; lock file gone at close
    assert [s for s, _ in list_checkpoints(ckpt)] == [TOTAL - 1, TOTAL]  # keep_last 2


def check_after_kill(ckpt: Path, seen: dict[str, object]) -> int:
    """After a kill: latest is the last completed save or the one in progress (if its pointer was already
    replaced), complete and intact; every complete checkpoint verifies. Returns latest's step."""
    assert os.WIFSIGNALED(seen["status"]) and os.WTERMSIG(seen["status"]) == signal.SIGKILL, seen  # type: ignore[arg-type]
    previous = max([seen["resumed"] or 0, *seen["saved"]])  # type: ignore[list-item]
    latest = find_checkpoint(ckpt)
    assert latest is not None and latest.parent == ckpt
    step = parse_step_dir(latest.name)
    assert step in (previous, seen["killed_during"]), \
        f"latest is {latest.name}; last completed save {previous}, killed in {seen['killed_during']}"
    assert (ckpt / "latest").read_text().strip() == latest.name
    verify_checkpoint(latest)
    for _, path in list_checkpoints(ckpt):
        verify_checkpoint(path)
    return step  # type: ignore[return-value]
