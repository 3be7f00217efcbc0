"""tierstore: tensors and bytes across three tiers (GPU HBM, pinned host memory, NVMe files).

The package knows nothing of nn.Module; the runtime builds on its public API:

- :class:`TierStore` -- key -> record of where each copy of a tensor lives; fetch / evict / release.
- :class:`TransferEngine` -- the only code that moves bytes; every transfer returns a :class:`Handle`.
- :class:`PinnedArena`, :class:`NVMeDirectory` -- the host and disk back ends.
- :class:`EventBus` / :class:`TransferEvent` -- what moved, where and when, for listeners such as a profiler.
- :func:`close_at_exit` -- closes what a program left open when the interpreter exits, before thread pools stop.
"""

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
from tierstore.keys import TensorKey, TensorMeta
from tierstore.lifecycle import close_at_exit, wait_at_exit
from tierstore.nvme import NVMeDirectory
from tierstore.pinned import PinnedArena
from tierstore.residency import CopyState, IllegalTransitionError
from tierstore.store import StoreConfig, TierStore, swap_tmp_root
from tierstore.tiers import Allocation, Tier, TierName
from tierstore.transfer import Handle, TransferEngine

__all__ = [
    "Allocation",
    "CapacityError",
    "CopyState",
    "CorruptFileError",
    "DirectoryLockedError",
    "EventBus",
    "Handle",
    "HostMemoryError",
    "IllegalTransitionError",
    "NVMeDirectory",
    "PinnedArena",
    "StoreConfig",
    "StoreIOError",
    "TensorKey",
    "TensorMeta",
    "Tier",
    "TierName",
    "TierStore",
    "TierStoreError",
    "TransferEngine",
    "TransferEvent",
    "UnsafeDirectoryError",
    "close_at_exit",
    "wait_at_exit",
    "swap_tmp_root",
]
