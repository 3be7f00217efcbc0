"""What a person reads when a run stops for a reason they can fix: one message, no traceback.

``user_message`` walks an exception and the ones it wraps (``raise ... from``, or raised while handling):
the optimizer worker, the IO threads and the checkpoint writer re-raise a failure in the training thread
inside a RuntimeError, and the cause is what the user can act on. It knows the errors tierstore raises on
purpose (config, plan, store, checkpoint) and the environment's (out of memory, permissions, a read-only
or full file system). Anything else is a bug: None, and the CLI lets the traceback through.
"""

from __future__ import annotations

import errno

import torch

from tierstore import CorruptFileError, TierStoreError

# Paths a run writes to, for messages that must say which setting chooses another one.
WRITTEN_PATHS = "tiers.nvme.path, --checkpoint-dir / train.checkpoint_dir, --profile / profile.dir"


def user_message(exc: BaseException) -> str | None:
    """The message for an error the user caused (or the machine did), or None for a bug."""
    wrapped = True  # so far every link was ``raise ... from``: exc says who re-raised it
    for error in _chain(exc):
        message = _describe(error)
        if message is not None:
            return message if error is exc or not wrapped else f"{message} ({_where(exc)})"
        wrapped = wrapped and error.__cause__ is not None
    return None


def _describe(error: BaseException) -> str | None:
    if isinstance(error, torch.OutOfMemoryError):
        first = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
        return (f"the GPU ran out of memory ({first}). Activations come on top of the plan: lower train.batch_size "
                "or train.seq_len, lower tiers.gpu.budget to leave them more room (the `auto` placement the plan shows "
                "shrinks with it), or lower prefetch.depth")
    if isinstance(error, OSError) and error.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.ENOMEM):
        return _describe_os_error(error)
    if isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and "can't allocate memory" in str(error)):
        # torch's CPU allocator raises RuntimeError("[enforce fail at alloc_cpu.cpp] ... can't allocate memory")
        first = str(error).strip().splitlines()[0] if str(error).strip() else "MemoryError"
        return (f"out of host memory ({first}); lower tiers.host.budget or train.batch_size, or put more state on "
                "nvme (placement.master / placement.moments)")
    if isinstance(error, CorruptFileError):
        return (f"{error}. Swap files are a cache of this run only: start again, from the latest checkpoint with "
                "--resume; if it happens again, check the drive under tiers.nvme.path")
    if isinstance(error, (TierStoreError, ValueError, FileNotFoundError, NotADirectoryError)):
        return str(error)
    return None


def _describe_os_error(error: OSError) -> str:
    path = getattr(error, "path", None) or error.filename or "a file"
    if error.errno == errno.EROFS:
        return (f"{path} is on a read-only file system: nothing can be written there. Pick a directory on a writable "
                f"file system ({WRITTEN_PATHS})")
    if error.errno in (errno.EACCES, errno.EPERM):
        return (f"permission denied writing or reading {path}: pick a directory this user owns ({WRITTEN_PATHS}) or "
                "have its owner grant access")
    if error.errno == errno.ENOSPC:
        return f"no space left on the file system holding {path}: free space there or pick another path ({WRITTEN_PATHS})"
    return f"out of host memory at {path} ({error.strerror}); lower tiers.host.budget or free host memory"


def _chain(exc: BaseException) -> list[BaseException]:
    """exc, then what it wraps, outermost first (cycles cut)."""
    out: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in out):
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def _where(exc: BaseException) -> str:
    """Who re-raised it: the wrapper's message up to its first colon, e.g. 'the optimizer worker failed'. (A
    failure during the cleanup after the error, found through ``__context__``, is not named: it is not why.)"""
    text = str(exc).split(":")[0].strip()
    return text or type(exc).__name__
