"""close_at_exit runs while thread pools still work, newest first, and only for live objects; reclaim_abandoned
removes exactly the swap directories whose owner is gone."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tierstore.lifecycle import reclaim_abandoned
from tierstore.nvme import LOCK_NAME

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_close_at_exit_order_pools_and_failures():
    script = textwrap.dedent("""
        import gc, multiprocessing, sys
        from concurrent.futures import ThreadPoolExecutor
        from tierstore import close_at_exit

        class Thing:
            def __init__(self, name, fail=False):
                self.name, self.fail, self.pool = name, fail, ThreadPoolExecutor(1)
                close_at_exit(self, Thing.close)
            def close(self):
                # A pool still takes work here: atexit would be too late (concurrent.futures stopped them).
                print("closed", self.name, self.pool.submit(lambda: 42).result(), flush=True)
                self.pool.shutdown()
                if self.fail:
                    raise OSError("disk gone")

        first, second, failing = Thing("first"), Thing("second"), Thing("failing", fail=True)
        collected = Thing("collected")
        del collected
        gc.collect()
        # A forked child (a DataLoader worker) inherits the hooks and runs them at its exit: they must not act.
        child = multiprocessing.get_context("fork").Process(target=print, args=("child",))
        child.start()
        child.join()
        print("end", child.exitcode, flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # Newest first; the failure is logged and the older ones are still closed; neither a collected object nor
    # the forked child closes anything.
    assert proc.stdout.splitlines() == ["child", "end 0", "closed failing 42", "closed second 42", "closed first 42"]
    assert "closing Thing at interpreter exit failed" in proc.stderr and "disk gone" in proc.stderr


def _swap_dir(root: Path, name: str, owner: str | None) -> Path:
    path = root / name
    path.mkdir()
    (path / "block0.master.tsw").write_bytes(b"x" * 4096)
    if owner is not None:
        (path / LOCK_NAME).write_text(owner)
    return path


def test_reclaim_abandoned_removes_only_what_a_dead_owner_left(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = gone.stdout.strip()
    dead = _swap_dir(tmp_path, "tierstore-nvme-dead", f"{dead_pid} {os.uname().nodename}")  # as lock_file writes it
    dead_bare = _swap_dir(tmp_path, "tierstore-nvme-dead-bare", dead_pid)  # an older lock: the pid alone
    elsewhere = _swap_dir(tmp_path, "tierstore-nvme-elsewhere", f"{dead_pid} another-host")  # a shared file system
    alive = _swap_dir(tmp_path, "tierstore-nvme-alive", str(os.getpid()))  # unlocked, but its owner runs
    starting = _swap_dir(tmp_path, "tierstore-nvme-starting", "")  # lock file made, pid not written yet
    no_lock = _swap_dir(tmp_path, "tierstore-nvme-nolock", None)
    held = _swap_dir(tmp_path, "tierstore-nvme-held", dead_pid)  # pid gone (reused?) but the lock is held
    other = _swap_dir(tmp_path, "something-else", dead_pid)
    fd = os.open(held / LOCK_NAME, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert reclaim_abandoned(tmp_path, "tierstore-nvme-") == [dead, dead_bare]
    finally:
        os.close(fd)
    assert not dead.exists() and not dead_bare.exists()
    assert all(p.exists() for p in (alive, starting, no_lock, held, other, elsewhere))
