"""tierstore: tensors and bytes across three tiers (GPU HBM, pinned host memory, NVMe files).

The package knows nothing of nn.Module; the runtime builds on its public API:

- :class:`TierStore` -- key -> record of where each copy of a tensor lives; fetch / evict / release.
- :class:`TransferEngine` -- the only code that moves bytes; every transfer returns a :class:`Handle`.
- :class:`PinnedArena`, :class:`NVMeDirectory` -- the host and disk back ends.
- :class:`Tiers` -- a store's tiers by name (``store.tiers``), each its own class: :class:`GpuTier` (``reserve``),
  :class:`HostTier` (``arena``), :class:`NvmeTier` (``directory``); :class:`Tier` declares what all three do.
- :class:`EventBus` / :class:`TransferEvent` -- what moved, where and when, for listeners such as a profiler.
- :func:`close_at_exit` -- closes what a program left open when the interpreter exits, before thread pools stop.
- :class:`Record` -- what the store knows of one key (home, each tier's copy, the step of its value).
- :data:`HEADER_NBYTES`, :func:`payload_hasher` -- a swap file's payload offset and checksum, for a reader that
  streams the payload itself (a checkpoint).
- :func:`create_new`, :func:`lock_file`, :func:`unlink_lock_file`, :func:`shared_directory_problem` -- the file safety
  the store's own files follow (no following planted links, one holder per directory and its lock file gone with it,
  private directories), for the runtime's files.
- :func:`align_up` -- a size rounded up to an alignment (the arena's and O_DIRECT's 4 KiB pages).
"""

from tierstore.allocator import align_up
from tierstore.errors import (
    CapacityError,
    CorruptFileError,
    DirectoryLockedError,
    HostMemoryError,
    StoreIOError,
    TierStoreError,
    UnsafeDirectoryError,
)
from tierstore.events import EventBus, TransferEvent
from tierstore.files import create_new, lock_file, shared_directory_problem, unlink_lock_file
from tierstore.keys import TensorKey, TensorMeta
from tierstore.lifecycle import close_at_exit, wait_at_exit
from tierstore.nvme import HEADER_NBYTES, NVMeDirectory, payload_hasher, remove_abandoned
from tierstore.pinned import PinnedArena
from tierstore.residency import CopyState, IllegalTransitionError
from tierstore.store import Record, StoreConfig, TierStore, swap_tmp_root
from tierstore.tiers import Allocation, GpuTier, HostTier, NvmeTier, Tier, TierName, Tiers
from tierstore.transfer import Handle, TransferEngine

__all__ = [
    "remove_abandoned",
    "HEADER_NBYTES",
    "Allocation",
    "CapacityError",
    "CopyState",
    "CorruptFileError",
    "DirectoryLockedError",
    "EventBus",
    "GpuTier",
    "Handle",
    "HostMemoryError",
    "HostTier",
    "IllegalTransitionError",
    "NVMeDirectory",
    "NvmeTier",
    "PinnedArena",
    "Record",
    "StoreConfig",
    "StoreIOError",
    "TensorKey",
    "TensorMeta",
    "Tier",
    "TierName",
    "TierStore",
    "TierStoreError",
    "Tiers",
    "TransferEngine",
    "TransferEvent",
    "UnsafeDirectoryError",
    "align_up",
    "close_at_exit",
    "create_new",
    "lock_file",
    "payload_hasher",
    "shared_directory_problem",
    "swap_tmp_root",
    "unlink_lock_file",
    "wait_at_exit",
]
