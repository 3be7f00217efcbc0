"""SIGTERM ends a training run the way Ctrl-C does: an exception in the main thread, so cleanup runs; both
are held back while tierstore's own code runs (see [Note: deferred interrupts]).

Schedulers and ``docker stop`` send SIGTERM, whose default action kills the process at once: swap files
stay behind (for the ``tmp`` swap path, in the RAM-backed /dev/shm until reboot) and nothing is said.
From the start of ``offload()`` (whose setup, filling the tiers, takes minutes at 8B: when schedulers send it)
until the session closes, SIGTERM instead raises :class:`Terminated` in the main thread at its next Python
instruction: ``finally`` blocks run, a setup is undone as for Ctrl-C (``runtime.session``), the step in
progress is abandoned, the session closes (here or at exit, see ``tierstore.close_at_exit``) and the process
exits with status 128 + 15. A checkpoint save cut short is never published (``checkpoint_io`` writes a new
directory and then swaps the ``latest`` pointer).

The handler is installed only where SIGTERM still has its default action and only from the main thread: a
program with its own handler keeps it. The first SIGTERM restores the default, so a second one kills a
process whose cleanup hangs.

[Note: deferred interrupts]
Ctrl-C (SIGINT, Python's KeyboardInterrupt) and SIGTERM raise in the main thread at whatever instruction it is
running. Inside tierstore's own code that may be between a copy and the event that says it ended, between
queueing a step's updates and recording that step, or while a condition's lock is re-taken: a fuzz of such
interrupts (2026-11-28) found the interrupt swallowed into a copy's handle and the optimizer worker dead with
it, a handle never completed (a hang), a close() that never returned, and a step half recorded. So while a
session is open the same handler object serves both signals (where each still has its default handler) and
holds them back while the main thread runs tierstore code: the entry points the user's code reaches (hooks,
the parameter guard, the optimizer's and the session's methods) and the store's construction in ``offload()``
(else a signal there left a store nothing could close) run under ``defers_interrupts``, and a signal
that arrives there is raised when the outermost of them returns, as if it had arrived just after it. A second
Ctrl-C while one is held raises at once, and a second SIGTERM kills as before: a wait that never ends stays
interruptible (the state may then be what the first interrupt found). What it leaves out: checkpoint saves and
loads (long, and built for faults: a save cut short is never published), SIGKILL (nothing can run; the next
start reclaims the swap directory), and signals handled by the program's own handlers, which it keeps.
"""

from __future__ import annotations

import _signal
import functools
import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger(__name__)


class Terminated(SystemExit):
    """SIGTERM arrived: raised in the main thread. A SystemExit, so ``except Exception`` does not swallow it
    and, uncaught, it ends the process without a traceback, with exit status 128 + the signal number."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"terminated by {signal.Signals(self.signum).name}"


class _SignalHandler:
    """The installed handler of SIGINT and SIGTERM (where each had its default); counts the sessions relying on
    it so the last one out restores the defaults, and holds a signal back while the main thread runs tierstore
    code (``depth`` > 0: [Note: deferred interrupts])."""

    def __init__(self) -> None:
        self.users = 0
        self.pid = os.getpid()
        self.depth = 0  # nesting of defers_interrupts calls running in the main thread
        self.held: int | None = None  # a signal that arrived at depth > 0, raised when depth returns to 0
        self.sigint_taken = False  # SIGINT is ours while a session is open (taken back if someone resets it)

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid:  # a forked child (a DataLoader worker) has no session: act as by default
            signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT else signal.default_int_handler)
            os.kill(os.getpid(), signum)
            return
        if self.depth > 0 and self.held is None:
            self.held = signum  # no logging here: the main thread may hold the logging lock
            if signum == signal.SIGTERM:  # as when raised at once: a second SIGTERM kills
                signal.signal(signum, signal.SIG_DFL)
            return
        # A second signal while one is held: the stronger one, at once (a held SIGTERM is not lost to a Ctrl-C).
        signum = signal.SIGTERM if signal.SIGTERM in (self.held, signum) else signum
        self.held = None
        self.raise_for(signum)

    def raise_for(self, signum: int) -> None:
        """What the signal does by default: KeyboardInterrupt for SIGINT, :class:`Terminated` for SIGTERM."""
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM kills even if the cleanup below hangs
        log.warning("%s received: abandoning the step, closing the session and removing its swap files",
                    signal.Signals(signum).name)
        raise Terminated(signum)

    def leave_deferred(self) -> None:
        """The outermost tierstore call returned: a signal held meanwhile is raised now."""
        self.depth -= 1
        if self.depth == 0 and self.held is not None:
            signum, self.held = self.held, None
            self.raise_for(signum)


_DEFAULTS: dict[int, Callable[[int, FrameType | None], Any] | signal.Handlers] = {
    signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


_MAIN_IDENT = threading.main_thread().ident


def _installed() -> _SignalHandler | None:
    # _signal's getsignal, not signal's: that one wraps each answer in an enum lookup, 2 us a call on a path every
    # torch call on a parameter takes (ParamGuard.dispatch), against 0.04.
    for signum in _DEFAULTS:
        handler = _signal.getsignal(signum)
        if isinstance(handler, _SignalHandler):
            return handler
    return None


def defers_interrupts(fn: F) -> F:
    """Run ``fn`` with SIGINT and SIGTERM held back while it runs in the main thread (see [Note: deferred
    interrupts]); a signal held meanwhile is raised when the outermost such call returns."""

    @functools.wraps(fn)
    def deferring(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != _MAIN_IDENT:  # hooks on autograd's device threads: signals never run there
            return fn(*args, **kwargs)
        handler = _installed()
        if handler is None:
            return fn(*args, **kwargs)
        if handler.depth == 0 and handler.sigint_taken and _signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, handler)  # ipykernel resets SIGINT before each cell: take it back
        handler.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            handler.leave_deferred()

    return deferring  # type: ignore[return-value]


def handle_signals() -> Callable[[], None]:
    """Make SIGTERM raise :class:`Terminated` in the main thread, and hold SIGINT and SIGTERM back inside
    tierstore's code, while the caller needs it; returns the function to call when it no longer does
    (idempotent). Does nothing outside the main thread, and leaves a signal whose handler the program set."""
    if threading.current_thread() is not threading.main_thread():
        return _nothing
    handler = _installed() or _SignalHandler()
    # (not a SIGTERM whose default a held SIGTERM put back: a second one must still kill)
    taken = [signum for signum, default in _DEFAULTS.items()
             if signal.getsignal(signum) is handler
             or (signal.getsignal(signum) == default and not (signum == signal.SIGTERM and handler.held == signum))]
    if not taken:
        return _nothing
    for signum in taken:
        signal.signal(signum, handler)
    handler.sigint_taken = handler.sigint_taken or signal.SIGINT in taken
    handler.users += 1
    left = False

    def leave() -> None:
        nonlocal left
        if left:
            return
        left = True
        handler.users -= 1
        # signal.signal works only in the main thread; a close() from another thread leaves the handler,
        # which then raises as by default with nothing left to clean up: the exit status is the same.
        if handler.users == 0 and threading.current_thread() is threading.main_thread():
            handler.sigint_taken = False
            for signum, default in _DEFAULTS.items():
                if signal.getsignal(signum) is handler:
                    signal.signal(signum, default)

    return leave


def _nothing() -> None:
    """What there is to undo when no handler was installed."""
