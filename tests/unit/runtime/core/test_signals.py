"""SIGTERM raises Terminated while a session needs it; the default comes back when the last one leaves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.core.signals import Terminated, defers_interrupts, handle_signals

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture(autouse=True)
def default_sigterm():
    """Each test starts and ends with SIGTERM and SIGINT at their defaults (pytest's own process must stay
    killable and interruptible)."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGTERM, previous)
    signal.signal(signal.SIGINT, previous_int)


def test_ctrl_c_inside_tierstore_code_is_raised_when_its_outermost_call_returns():
    """[Note: deferred interrupts]: a SIGINT that arrives inside a defers_interrupts call (nested here) lets the
    call finish and is raised as it returns; a second one while the first is held raises at once."""
    leave = handle_signals()
    done: list[str] = []

    @defers_interrupts
    def inner() -> None:
        signal.raise_signal(signal.SIGINT)  # the handler runs at the next bytecode, in this thread
        done.append("inner")

    @defers_interrupts
    def outer() -> str:
        inner()
        done.append("outer")
        return "result"

    with pytest.raises(KeyboardInterrupt):
        outer()
    assert done == ["inner", "outer"]

    @defers_interrupts
    def stuck() -> None:
        signal.raise_signal(signal.SIGINT)  # held
        signal.raise_signal(signal.SIGINT)  # a second Ctrl-C: at once
        done.append("never")

    with pytest.raises(KeyboardInterrupt):
        stuck()
    assert "never" not in done
    assert defers_interrupts(lambda: "clean")() == "clean"  # nothing held is left over
    leave()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_raises_terminated_and_a_second_one_would_kill():
    leave = handle_signals()
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)  # else the kill below ends pytest
    with pytest.raises(Terminated) as info:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode, in this thread
    assert info.value.code == 128 + signal.SIGTERM and str(info.value) == "terminated by SIGTERM"
    assert isinstance(info.value, SystemExit) and not isinstance(info.value, Exception)  # `except Exception` lets it by
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # first delivery restored the default
    leave()


def test_the_last_session_out_restores_the_default():
    first, second = handle_signals(), handle_signals()
    handler = signal.getsignal(signal.SIGTERM)
    first()
    first()  # idempotent: does not count twice
    assert signal.getsignal(signal.SIGTERM) is handler
    second()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_programs_own_handler_is_left_alone():
    def mine(signum, frame):
        pass

    signal.signal(signal.SIGTERM, mine)
    leave = handle_signals()
    assert signal.getsignal(signal.SIGTERM) is mine
    leave()
    assert signal.getsignal(signal.SIGTERM) is mine


@pytest.mark.slow
def test_a_forked_child_dies_of_sigterm_as_by_default():
    script = textwrap.dedent("""
        import os, signal, sys, time
        from runtime.core.signals import handle_signals
        handle_signals()
        pid = os.fork()
        if pid == 0:  # a DataLoader worker, say: it has no session to close
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # not reached: SIGTERM kills it first; the sleep bounds a signal that did not
            os._exit(7)
        _, status = os.waitpid(pid, 0)
        print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", (proc.stdout, proc.stderr)
    assert "received" not in proc.stderr  # no message about a session it does not have


def test_a_sessions_close_gives_sigterm_back():
    """offload() makes SIGTERM raise Terminated; the session's close() leaves it (it ran none of its on_close
    callbacks before, so a script that closed its session and went on still turned SIGTERM into an exception)."""
    import torch

    from runtime import offload
    from runtime.bundled.example_model import ExampleLM, ModelShape

    torch.manual_seed(0)
    model = ExampleLM(ModelShape(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, ffn_size=64))
    model, optimizer = offload(model, {"dtype": "fp32"})
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
    optimizer.session.close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_sigterm_inside_tierstore_code_is_raised_on_return_and_a_second_would_kill():
    leave = handle_signals()
    seen: list[object] = []

    @defers_interrupts
    def work() -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # held: the call goes on
        seen.append(signal.getsignal(signal.SIGTERM))

    with pytest.raises(Terminated):
        work()
    assert seen == [signal.SIG_DFL]  # while held, a second SIGTERM would have killed, as before
    leave()


def test_a_ctrl_c_after_a_held_sigterm_raises_terminated_not_keyboard_interrupt():
    """A second signal while one is held raises the stronger: a held SIGTERM is not lost to a Ctrl-C (found by a
    review)."""
    leave = handle_signals()

    @defers_interrupts
    def work() -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # held
        signal.raise_signal(signal.SIGINT)  # second: raised at once, as the SIGTERM

    with pytest.raises(Terminated):
        work()
    leave()


def test_sigint_reset_to_the_default_by_someone_else_is_taken_back():
    """ipykernel sets SIGINT to Python's default before each cell: the next tierstore call takes it back, so a
    Ctrl-C inside tierstore code is still held (found by a review)."""
    leave = handle_signals()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    done: list[str] = []

    @defers_interrupts
    def work() -> None:
        signal.raise_signal(signal.SIGINT)
        done.append("finished")

    with pytest.raises(KeyboardInterrupt):
        work()
    assert done == ["finished"]
    leave()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
