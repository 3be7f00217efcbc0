"""SIGTERM ends a training run the way Ctrl-C does: an exception in the main thread, so cleanup runs.

Schedulers and ``docker stop`` send SIGTERM, whose default action kills the process at once: swap files
stay behind (for the ``tmp`` swap path, in the RAM-backed /dev/shm until reboot) and nothing is said.
While a session is open, SIGTERM instead raises :class:`Terminated` in the main thread at its next Python
instruction: ``finally`` blocks run, the step in progress is abandoned, the session closes (here or at
exit, see ``tierstore.close_at_exit``) and the process exits with status 128 + 15. A checkpoint save cut
short is never published (``checkpoint_io`` writes a new directory and then swaps the ``latest`` pointer).

The handler is installed only where SIGTERM still has its default action and only from the main thread: a
program with its own handler keeps it. The first SIGTERM restores the default, so a second one kills a
process whose cleanup hangs. What it leaves out: SIGINT (Python's KeyboardInterrupt already does this) and
SIGKILL (nothing can run; the next start reclaims the swap directory).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Callable

log = logging.getLogger(__name__)


class Terminated(SystemExit):
    """SIGTERM arrived: raised in the main thread. A SystemExit, so ``except Exception`` does not swallow it
    and, uncaught, it ends the process without a traceback, with exit status 128 + the signal number."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"terminated by {signal.Signals(self.signum).name}"


class _TerminateHandler:
    """The installed handler; counts the sessions relying on it so the last one out restores the default."""

    def __init__(self) -> None:
        self.users = 0
        self.pid = os.getpid()

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM kills even if the cleanup below hangs
        if os.getpid() != self.pid:  # a forked child (a DataLoader worker) has no session: die as by default
            os.kill(os.getpid(), signum)
            return
        log.warning("%s received: abandoning the step, closing the session and removing its swap files",
                    signal.Signals(signum).name)
        raise Terminated(signum)


def stop_on_sigterm() -> Callable[[], None]:
    """Make SIGTERM raise :class:`Terminated` in the main thread while the caller needs it; returns the
    function to call when it no longer does (idempotent). Does nothing outside the main thread or where the
    program installed its own SIGTERM handler."""
    if threading.current_thread() is not threading.main_thread():
        return _nothing
    current = signal.getsignal(signal.SIGTERM)
    if isinstance(current, _TerminateHandler):
        handler = current
    elif current == signal.SIG_DFL:
        handler = _TerminateHandler()
        signal.signal(signal.SIGTERM, handler)
    else:
        return _nothing
    handler.users += 1
    left = False

    def leave() -> None:
        nonlocal left
        if left:
            return
        left = True
        handler.users -= 1
        # signal.signal works only in the main thread; a close() from another thread leaves the handler,
        # which then raises Terminated with nothing left to clean up: the exit status is the same.
        if (handler.users == 0 and signal.getsignal(signal.SIGTERM) is handler
                and threading.current_thread() is threading.main_thread()):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    return leave


def _nothing() -> None:
    """What there is to undo when no handler was installed."""
