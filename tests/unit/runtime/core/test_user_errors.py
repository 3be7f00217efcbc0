"""Errors a user can cause get one clear message (``runtime.core.user_errors``); bugs get None (a traceback)."""

from __future__ import annotations

import errno

import pytest
import torch

from runtime.config.loader import ConfigError
from runtime.core.user_errors import user_message
from tierstore import CorruptFileError, StoreIOError


def wrapped(inner: BaseException, outer: str = "the optimizer worker failed") -> RuntimeError:
    """inner re-raised in another thread's wrapper, as UpdateWorker does."""
    try:
        raise RuntimeError(f"{outer}: {inner!r}") from inner
    except RuntimeError as exc:
        return exc


def test_a_corrupt_swap_file_behind_the_worker_names_the_file():
    message = user_message(wrapped(CorruptFileError("/swap/block3.master.tsw", "payload checksum mismatch")))
    assert message is not None
    assert message.startswith("swap file /swap/block3.master.tsw is corrupt: payload checksum mismatch. ")
    assert message.endswith("(the optimizer worker failed)") and "--resume" in message


def test_cuda_out_of_memory_says_what_to_lower():
    message = user_message(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail"))
    assert message is not None and message.startswith("the GPU ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB)")
    assert "train.batch_size" in message and "tiers.gpu.budget" in message


@pytest.mark.parametrize("code,phrase", [
    (errno.EROFS, "/ckpt/step-000001 is on a read-only file system"),
    (errno.EACCES, "permission denied writing or reading /ckpt/step-000001"),
    (errno.ENOSPC, "no space left on the file system holding /ckpt/step-000001"),
])
def test_file_system_errors_name_the_path_and_the_settings(code, phrase):
    message = user_message(OSError(code, "whatever the OS says", "/ckpt/step-000001"))
    assert message is not None and message.startswith(phrase) and "--checkpoint-dir" in message
    assert "chmod" not in message


def test_host_out_of_memory_from_torchs_cpu_allocator():
    error = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                         "you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")
    message = user_message(error)
    assert message is not None and message.startswith("out of host memory ([enforce fail") and "tiers.host.budget" in message


def test_a_store_io_error_uses_its_own_path():
    error = StoreIOError(errno.EROFS, "write failed", "/swap/block0.master.tsw", 4096)
    assert user_message(error).startswith("/swap/block0.master.tsw is on a read-only file system")


def test_config_and_value_errors_pass_through():
    error = ConfigError("tiers.host.budget must be a size")
    assert user_message(error) == str(error)
    assert user_message(ValueError("--resume needs --checkpoint-dir DIR")) == "--resume needs --checkpoint-dir DIR"


@pytest.mark.parametrize("bug", [RuntimeError("invariant broken"), KeyError("x"), AssertionError("no"),
                                 wrapped(KeyError("inner bug"))])
def test_bugs_have_no_user_message(bug):
    assert user_message(bug) is None


def test_a_failure_during_cleanup_does_not_hide_the_cause():
    try:
        try:
            raise CorruptFileError("/swap/block0.master.tsw", "payload checksum mismatch")
        except CorruptFileError:
            raise RuntimeError("Attempted to call `variable.set_data(tensor)`: incompatible tensor type")  # noqa: B904
    except RuntimeError as exc:
        message = user_message(exc)
    assert message is not None and message.startswith("swap file /swap/block0.master.tsw is corrupt")
    assert "set_data" not in message
