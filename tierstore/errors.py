"""Exceptions raised by tierstore. User-facing errors name what to change; broken invariants are RuntimeError."""

from __future__ import annotations


class TierStoreError(Exception):
    """Base class of every error tierstore raises on purpose."""


class CapacityError(TierStoreError):
    """An allocation would exceed a tier's byte budget. Nothing was allocated or written."""

    def __init__(self, tier: str, requested_nbytes: int, used_nbytes: int, capacity_nbytes: int, what: str):
        self.tier = tier
        self.requested_nbytes = requested_nbytes
        self.used_nbytes = used_nbytes
        self.capacity_nbytes = capacity_nbytes
        free = capacity_nbytes - used_nbytes
        super().__init__(
            f"{tier} tier is full: {what} needs {requested_nbytes:,} bytes but only {free:,} of "
            f"{capacity_nbytes:,} are free ({used_nbytes:,} in use). Raise the {tier} budget in the config "
            f"or place this kind of state on another tier."
        )


class HostMemoryError(TierStoreError):
    """The host arena could not be mapped or page-locked: the machine (or a cgroup) refused the memory."""

    def __init__(self, capacity_nbytes: int, step: str, reason: str):
        self.capacity_nbytes = capacity_nbytes
        super().__init__(
            f"could not {step} the host arena of {capacity_nbytes:,} bytes ({capacity_nbytes / 2**30:.2f} GiB): {reason}. "
            f"Lower tiers.host.budget (auto sizes it to the plan) or free host memory; `tierstore plan` shows the "
            f"RAM this process may use."
        )


class StoreIOError(TierStoreError, OSError):
    """A file operation failed or moved fewer bytes than asked; names the file, offset and errno."""

    def __init__(self, errno_: int | None, message: str, path: str, offset: int):
        OSError.__init__(self, errno_ or 0, message)
        self.path = path
        self.offset = offset
        self.errno_name = _errno_name(errno_)

    def __str__(self) -> str:
        return f"{self.strerror} [{self.errno_name}] (file {self.path}, offset {self.offset})"


class CorruptFileError(TierStoreError):
    """A swap file's header or checksum does not match what the store wrote."""

    def __init__(self, path: str, reason: str):
        self.path = path
        super().__init__(f"swap file {path} is corrupt: {reason}")


class DirectoryLockedError(TierStoreError):
    """Another process (or another store in this process) holds the NVMe directory."""


class UnsafeDirectoryError(TierStoreError):
    """A directory tierstore would write into can be written by other users (or is not ours): refused, because
    they could plant links at the names we create or replace our files."""


def _errno_name(errno_: int | None) -> str:
    import errno as errno_module

    if not errno_:
        return "short IO"
    return errno_module.errorcode.get(errno_, str(errno_))
