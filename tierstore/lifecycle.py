"""Closing what a program forgot to close, at interpreter exit, while its threads still run; reclaiming
what a killed one left.

A script that returns without ``close()`` leaves an update worker thread, an IO thread pool and swap files
behind. ``atexit`` is too late for them: Python first runs the threading module's exit hooks, and
``concurrent.futures`` uses one to stop every thread pool (later submits raise "cannot schedule new futures
after interpreter shutdown"); daemon threads then run on into finalization (on CUDA a thread calling into
the driver there aborts the process). ``close_at_exit`` registers with those same threading exit hooks,
which run newest first: an object registered after ``concurrent.futures`` was imported is closed while its
thread pools, its worker threads and CUDA still work. Those hooks run before Python joins the program's own
non-daemon threads: ``wait_at_exit`` registers one that first waits for the thread driving an object (a training
thread the main one did not join trains on to its end, as it would without tierstore, before anything it uses is
closed).

It holds a weak reference only: registering changes no object's lifetime, and a closed or collected object
costs nothing at exit. A forked child (a DataLoader worker) inherits the hooks and runs them at its own exit;
they do nothing there: the objects, and the files they would delete, belong to the parent. What it leaves out:
signals (``runtime.core.signals``) and ``os._exit`` (nothing runs).
What no exit hook can clean (a process killed by SIGKILL), ``reclaim_abandoned`` removes at the next start.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread
import fcntl
import logging
import os
import shutil
import stat
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tierstore.nvme import LOCK_NAME

log = logging.getLogger(__name__)

T = TypeVar("T")

_pool_worker = getattr(concurrent.futures.thread, "_worker", None)  # what a ThreadPoolExecutor's threads run


def close_at_exit(obj: T, close: Callable[[T], object]) -> None:
    """Call ``close(obj)`` when the interpreter exits if ``obj`` is still alive, before thread pools stop.

    Objects registered later are closed first (a session before the store it owns). ``close`` must be
    idempotent: it also runs for objects the program closed itself. Its errors are logged, never raised
    (an exception there would skip the remaining exit hooks, the thread pools' own among them).
    """
    def act(target: T) -> None:
        try:
            close(target)
        except Exception:
            log.exception("closing %s at interpreter exit failed", type(target).__name__)

    _at_exit(obj, act)


def wait_at_exit(obj: T, driver: Callable[[T], threading.Thread | None]) -> None:
    """At interpreter exit, if ``obj`` is still alive, wait for the thread ``driver(obj)`` names (None: none, or
    ``obj`` is closed) when it is alive, not the exiting one, not a daemon and not a thread pool's. Python joins a
    program's non-daemon threads only after the exit hooks that close tierstore's objects; registered after those
    objects, this runs before their hooks. Ctrl-C ends the wait, not the closing that follows (logged)."""
    def act(target: T) -> None:
        thread = driver(target)
        if thread is None or thread is threading.current_thread() or not thread.is_alive() or thread.daemon:
            return  # a daemon thread Python would not wait for either
        if getattr(thread, "_target", None) is _pool_worker:
            return  # a thread pool's worker: idle until its pool's own exit hook, which runs after this one

        log.info("interpreter exit: waiting for thread %r to finish before closing %s", thread.name, type(target).__name__)
        try:
            thread.join()
        except KeyboardInterrupt:
            log.warning("interpreter exit: stopped waiting for thread %r (Ctrl-C); closing %s under it",
                        thread.name, type(target).__name__)

    _at_exit(obj, act)


def _at_exit(obj: T, act: Callable[[T], None]) -> None:
    """Run ``act(obj)`` among the threading exit hooks (newest first) if ``obj`` is alive then; a weak reference only."""
    ref = weakref.ref(obj)
    owner = os.getpid()

    def hook() -> None:
        # A forked child inherits the hook and runs it too (multiprocessing's children call the threading exit
        # hooks): closing its copy would delete the parent's swap files, which are the same files.
        target = ref() if os.getpid() == owner else None
        if target is not None:
            act(target)

    # threading._register_atexit is what concurrent.futures itself uses (Python 3.9+); atexit is the fallback
    # for an interpreter without it, where pools may already be stopped but files are still removed.
    register = getattr(threading, "_register_atexit", atexit.register)
    try:
        register(hook)
    except RuntimeError:  # the interpreter is already shutting down: nothing later would run it
        log.debug("interpreter shutting down; %s is not closed at exit", type(obj).__name__)


def reclaim_abandoned(root: str | os.PathLike[str], prefix: str) -> list[Path]:
    """Delete the swap directories named ``prefix*`` under ``root`` that a killed process left behind
    (SIGKILL, the OOM killer: no exit hook ran). Only this user's directories whose lock no process holds
    and whose owner (the pid and host written in the lock file) is gone from this host; a directory being set
    up (no lock file or no pid yet) is left alone. Returns the directories removed."""
    removed = []
    for path in sorted(Path(root).glob(prefix + "*")):
        try:
            info = path.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            fd = os.open(path / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live store holds it
            owner = os.pread(fd, 256, 0).decode(errors="replace").split()  # "pid host" (tierstore.files.lock_file)
            if not owner or not owner[0].isdigit() or owner[1:2] not in ([], [os.uname().nodename]):
                continue  # being set up (no pid yet), or another host's (a shared file system)
            if _pid_alive(int(owner[0])):
                continue  # its owner is setting it up or closing it right now
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.warning("removed %d swap director%s left by killed runs: %s", len(removed), "y" if len(removed) == 1 else "ies",
                    ", ".join(str(p) for p in removed))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
