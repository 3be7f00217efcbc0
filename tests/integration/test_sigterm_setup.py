"""SIGTERM at any moment of ``offload()``'s setup, the steps and ``close()`` ends the process with status 143 and
leaves nothing behind (issue 41): no swap file, no lock file, no ``tmp`` directory on /dev/shm, no core dump.

Before, only an open session turned SIGTERM into an exception: during the setup (pinning and filling the tiers,
writing spilled moments: minutes at 8B, exactly when schedulers send it) its default action killed the process
and left the swap files written so far (on /dev/shm, RAM until the next start), where Ctrl-C at the same point
cleaned up. The setup now takes SIGTERM from its start (``runtime.session.offload``), unless the program has a
handler of its own.

The quick tests signal from inside the setup (the ``init`` callback of a model built on the meta device, which
runs block by block as the store is filled) and at one point in a child process. The slow sweep runs a child
(``tests.integration.sigterm_child``: a user's script without a handler, and ``tierstore train``) that signals
itself at the N-th call into runtime/ or tierstore/ made by its main thread, for N spread over everything from
the start of ``offload()`` to the end of ``close()``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM
from runtime.checkpoint.files import find_checkpoint, list_checkpoints, verify_checkpoint
from runtime.core.signals import Terminated
from tests.integration.checkpoint_training import tiny_cli_config
from tests.integration.test_user_contract import SHAPE, config
from tierstore.store import TMP_SWAP_PREFIX

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 180
TERMINATED = 128 + signal.SIGTERM  # the exit status of a process Terminated ended (a shell shows the same for a kill)


@pytest.fixture
def default_signals() -> Iterator[None]:
    """SIGTERM and SIGINT at their defaults for the test, as a script starts with them, and as before after it."""
    previous = {signum: signal.signal(signum, default)
                for signum, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler))}
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def tierstore_handles_sigterm() -> bool:
    """SIGTERM has tierstore's handler now (``runtime.core.signals``), not its default action: a SIGTERM sent
    without it would end pytest itself."""
    return type(signal.getsignal(signal.SIGTERM)).__name__ == "_SignalHandler"


def meta_model() -> ExampleLM:
    with torch.device("meta"):
        return ExampleLM(SHAPE)


# ---- in this process: SIGTERM from inside the setup ------------------------------------------------------------
@pytest.mark.usefixtures("default_signals")
def test_sigterm_while_the_setup_fills_the_tiers_undoes_it_and_raises_terminated(tmp_path):
    """The signal arrives while the third block is filled, two blocks' swap files already written: Terminated (exit
    status 143) comes out of offload(), the swap directory is left as found (no swap file, no lock file), no thread
    of the session runs, and both signals have their defaults again."""
    threads = set(threading.enumerate())
    filled: list[str] = []

    def init(name: str, tensor: torch.Tensor) -> None:
        filled.append(name)
        torch.nn.init.normal_(tensor, std=0.02)
        if name.startswith("layers.1."):  # blocks: the embedding, then each layer
            assert tierstore_handles_sigterm(), "offload() left SIGTERM at its default action during its setup"
            assert list((tmp_path / "swap").glob("*.tsw")), "no swap file written yet: this test would prove nothing"
            signal.raise_signal(signal.SIGTERM)  # raised at the next instruction, in this (the main) thread

    with pytest.raises(Terminated) as ended:
        offload(meta_model(), config(tmp_path), init=init)
    assert ended.value.code == TERMINATED
    assert os.listdir(tmp_path / "swap") == []
    assert {t for t in threading.enumerate() if t.is_alive()} <= threads
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _, optimizer = offload(meta_model(), config(tmp_path), init=lambda name, tensor: tensor.zero_())
    optimizer.session.close()  # the directory is free for the next run


@pytest.mark.usefixtures("default_signals")
def test_a_programs_own_sigterm_handler_is_left_alone_during_the_setup_and_after(tmp_path):
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    signal.signal(signal.SIGTERM, mine)
    handlers = []
    _, optimizer = offload(meta_model(), config(tmp_path),
                           init=lambda name, tensor: handlers.append(signal.getsignal(signal.SIGTERM)) or tensor.zero_())
    assert handlers and all(handler is mine for handler in handlers)
    assert signal.getsignal(signal.SIGTERM) is mine
    optimizer.session.close()
    assert signal.getsignal(signal.SIGTERM) is mine and seen == []


@pytest.mark.usefixtures("default_signals")
def test_the_handler_taken_for_the_setup_stays_with_the_session_and_goes_at_close_or_at_a_refusal(tmp_path):
    _, optimizer = offload(meta_model(), config(tmp_path), init=lambda name, tensor: tensor.zero_())
    assert tierstore_handles_sigterm()
    optimizer.session.close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    with pytest.raises(ValueError, match="meta device"):  # refused before anything is allocated
        offload(meta_model(), config(tmp_path))
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("default_signals")
def test_sigterm_while_an_interrupted_setup_is_undone_lets_the_undo_finish_then_raises_terminated(tmp_path, monkeypatch):
    """Ctrl-C during the setup, then SIGTERM while the undo gives the parameters back: the undo goes on to close the
    store (before, Terminated left the undo there, the swap files and the directory's lock kept until exit), then
    Terminated is raised in place of the KeyboardInterrupt."""
    import runtime.session

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    give_back = runtime.session._give_back_parameters

    def terminated_during(*args, **kwargs):
        assert tierstore_handles_sigterm()
        signal.raise_signal(signal.SIGTERM)
        give_back(*args, **kwargs)  # not reached: Terminated is raised at the line above

    monkeypatch.setattr(runtime.session, "OffloadAdamW", interrupt)  # late in the setup: every swap file written
    monkeypatch.setattr(runtime.session, "_give_back_parameters", terminated_during)
    with pytest.raises(Terminated):
        offload(meta_model(), config(tmp_path), init=lambda name, tensor: tensor.zero_())
    assert os.listdir(tmp_path / "swap") == []
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


# ---- in a child process: the exit status and what is left -------------------------------------------------------
def tmp_swap_dirs() -> dict[Path, str]:
    """The ``tmp`` swap path's directories on this machine, each with the owner its lock file names ("" if none)."""
    root = Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    found = {}
    for path in root.glob(TMP_SWAP_PREFIX + "*") if root is not None else ():
        try:
            found[path] = (path / ".tierstore.lock").read_text()
        except OSError:
            found[path] = ""
    return found


def run_child(tmp_path: Path, at: str, *args: str) -> tuple[int, str, str, int]:
    """Run ``tests.integration.sigterm_child`` with ``SIGTERM_CHILD_AT=at``, its TMPDIR and working directory under
    tmp_path; returns its status, stdout, stderr and pid."""
    (tmp_path / "tmpdir").mkdir(exist_ok=True)
    (tmp_path / "cwd").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "SIGTERM_CHILD_AT": at, "TMPDIR": str(tmp_path / "tmpdir"), "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen([sys.executable, "-m", "tests.integration.sigterm_child", *args], cwd=tmp_path / "cwd",
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"the child hung after {at}: {out}\n{err[-3000:]}") from None
    return proc.returncode, out, err, proc.pid


def assert_ended_cleanly(tmp_path: Path, child: tuple[int, str, str, int], swap: Path | None,
                         shm_before: dict[Path, str]) -> None:
    """Status 143 where tierstore's handler had SIGTERM (the default kill where it did not: outside a session, with
    nothing of it left), no traceback or fault, and nothing left: swap files, lock files, tmp directories, core."""
    code, out, err, pid = child
    where = f"{out.strip()}\n{err[-3000:]}"
    kill = next((line.split() for line in out.splitlines() if line.startswith("KILL ")), None)
    assert kill is not None, f"the child never signalled itself (status {code}): {where}"
    assert code == (TERMINATED if kill[2] == "handler" else -signal.SIGTERM), f"status {code}: {where}"
    assert "Traceback" not in err and "Fatal Python error" not in err, where
    if swap is not None:
        assert os.listdir(swap) == [], where  # no swap file, no lock file, no probe
    assert [p for p in os.listdir(tmp_path / "tmpdir") if not p.startswith("torchinductor_")] == [], where  # torch's cache
    assert not [p for p in os.listdir(tmp_path / "cwd") if p.startswith("core")], where
    left = {path: owner for path, owner in tmp_swap_dirs().items() if path not in shm_before}
    ours = [path for path, owner in left.items() if not owner or owner.split()[0] == str(pid)]
    assert ours == [], f"tmp swap directories left: {ours}: {where}"


@pytest.mark.parametrize("swap, at, where", [("dir", "register:3", "TierStore.register"),
                                              ("tmp", "register:3", "TierStore.register"),
                                              ("dir", "NvmeTier.__init__:1", "NvmeTier.__init__")])
def test_sigterm_in_the_setup_of_a_script_ends_it_with_143_and_nothing_left(tmp_path, swap, at, where):
    """A user's script without a handler, signalled at the store's third registration (the first block's swap
    files written): before, it was killed by the default action with the swap files (or the /dev/shm directory)
    left. And as the store is built, its swap directory locked: the signal is held until the store is offload()'s
    to close (before, the store never reached offload() and the lock file stayed)."""
    directory = tmp_path / "swap"
    directory.mkdir()
    shm_before = tmp_swap_dirs()
    child = run_child(tmp_path, at, "api", str(directory) if swap == "dir" else "tmp")
    assert f"KILL {at.rpartition(':')[2]} handler {where}" in child[1], child[1:3]
    assert_ended_cleanly(tmp_path, child, directory, shm_before)


# ---- the sweep: many points of setup, steps and close ------------------------------------------------------------
def handled_span(tmp_path: Path, *args: str) -> tuple[int, int, int]:
    """A run signalled nowhere: (calls made, first and last call at which tierstore's handler had SIGTERM)."""
    code, out, err, _ = run_child(tmp_path, "count", *args)
    assert code == 0, err[-3000:]
    calls, first, last = (int(word) for word in next(line for line in out.splitlines() if line.startswith("COUNT")).split()[1:])
    assert 0 < first < last <= calls, out
    return calls, first, last


def spread(first: int, last: int, num: int) -> list[int]:
    """``num`` calls from ``first`` to near ``last``, evenly apart. The calls a run makes vary by a few in a thousand
    (the main thread's waits on the worker and IO threads): the last is left for the named points below."""
    last -= (last - first) // 50
    return sorted({first + (last - first) * i // (num - 1) for i in range(num)})


# Named points of the setup: the swap directory's O_DIRECT probe, just after its lock is taken, and the store's
# assembly after its swap directory is open (a signal at each left the lock file: found by this sweep).
IN_SETUP = ["probe_direct_io:1", "NvmeTier.__init__:1", "Tiers.__init__:1"]
# The end of close(), named (their ordinal is the same in every run): the session's close, the store's, a swap
# file's removal, the swap directory's unlock and the handler's release (the last call with it in place).
IN_CLOSE = ["OffloadSession.close:1", "TierStore.close:1", "NVMeDirectory.remove:2", "NVMeDirectory._release_lock:1",
            "handle_signals.<locals>.leave:1"]


@pytest.mark.slow
@pytest.mark.parametrize("swap, num", [("dir", 6), ("tmp", 3)])
def test_sigterm_anywhere_in_a_script_ends_it_with_143_and_nothing_left(tmp_path, swap, num):
    """A user's script (no handler of its own) signalled at ``num`` points from the start of offload() to near the end
    of close(), at named points of close(), and once before offload() (the default action there: nothing to leave)."""
    sweep_script(tmp_path, swap, num)


@pytest.mark.gpu
@pytest.mark.parametrize("swap, num", [("dir", 16), ("tmp", 6)])
def test_sigterm_anywhere_in_a_cuda_script_ends_it_with_143_and_nothing_left(tmp_path, swap, num):
    """As above on the GPU: pinned memory, device copies and NVMe IO in flight when the signal lands (a close that
    freed the pinned arena under an IO write once ended such a run in a segmentation fault)."""
    sweep_script(tmp_path, swap, num, "cuda")


def sweep_script(tmp_path: Path, swap: str, num: int, *device: str) -> None:
    """The script sweep: signalled before offload(), at ``num`` points of the handled span and at ``IN_CLOSE``."""
    def args(directory: Path) -> list[str]:
        directory.mkdir()
        return ["api", str(directory) if swap == "dir" else "tmp", *device]

    calls, first, last = handled_span(tmp_path, *args(tmp_path / "count"))
    for point in [str(first // 2), *map(str, spread(first, last, num)), *IN_SETUP, *IN_CLOSE]:
        directory = tmp_path / f"at-{len(os.listdir(tmp_path))}"
        shm_before = tmp_swap_dirs()
        child = run_child(tmp_path, point, *args(directory))
        handled = not point.isdigit() or first <= int(point) <= last
        assert f"KILL {point.rpartition(':')[2]} {'handler' if handled else 'default'}" in child[1], (point, child[1:3])
        assert_ended_cleanly(tmp_path, child, directory, shm_before)


@pytest.mark.slow
def test_sigterm_anywhere_in_tierstore_train_ends_it_with_143_and_nothing_left_and_the_checkpoints_whole(tmp_path):
    """``tierstore train`` saving every step, signalled at points across the command (runtime.cli.main takes SIGTERM
    for all of it: the checkpoint root opened before offload() and closed after the session's close() too): status
    143, the message, no swap or lock file, and every checkpoint published is whole (a save cut short left no
    scratch directory)."""
    config = tiny_cli_config(tmp_path, "  steps: 3\n")
    calls, first, last = handled_span(tmp_path, "cli", str(config), str(tmp_path / "ckpt-count"))
    for point in [*map(str, spread(first, last, 5)), *IN_SETUP, *IN_CLOSE]:
        checkpoints = tmp_path / f"ckpt-{len(os.listdir(tmp_path))}"
        child = run_child(tmp_path, point, "cli", str(config), str(checkpoints))
        assert f"KILL {point.rpartition(':')[2]} handler" in child[1], (point, child[1:3])
        assert "terminated by SIGTERM" in child[2], child[2][-3000:]
        assert_ended_cleanly(tmp_path, child, tmp_path / "swap", {})
        if checkpoints.exists():
            assert [p.name for p in checkpoints.iterdir() if p.name.startswith(".")] == [], point
            latest = find_checkpoint(checkpoints)
            assert latest is not None or list_checkpoints(checkpoints) == [], point
            if latest is not None:
                verify_checkpoint(latest)
