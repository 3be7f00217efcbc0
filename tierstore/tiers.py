"""The three tiers behind one small interface: allocate / free / tensor, with enforced byte budgets.

``Tier`` declares what every tier does (budget, allocate, free, close). What only one tier does stays on that
tier's class: ``GpuTier.reserve`` / ``unreserve`` (device memory a caller allocates itself), ``HostTier.arena`` and
``io_buffer``, ``NvmeTier.directory``. ``Tiers``, the store's tiers by name, gives each name its own class
(``store.tiers[TierName.GPU]`` is a ``GpuTier``), so such a call type-checks where it is right and is refused by
the type checker where it is not, rather than failing at run time on a tier that cannot do it.
"""

from __future__ import annotations

import abc
import enum
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, overload

import torch

from tierstore.errors import CapacityError
from tierstore.keys import TensorKey, TensorMeta
from tierstore.nvme import NVMeDirectory, SwapFile
from tierstore.pinned import PinnedArena


class TierName(enum.StrEnum):
    """The tiers, fastest first. Order matters: a lower index is closer to the compute."""

    GPU = "gpu"
    HOST = "host"
    NVME = "nvme"

    @property
    def rank(self) -> int:
        """0 for the GPU, 2 for NVMe."""
        return list(TierName).index(self)


@dataclass
class Allocation:
    """Bytes reserved on one tier for one key. ``tensor`` is a flat view of meta's dtype (None on NVMe)."""

    key: TensorKey
    meta: TensorMeta
    reserved_nbytes: int
    tensor: torch.Tensor | None = None
    offset: int = -1
    swap: SwapFile | None = None

    def require_tensor(self) -> torch.Tensor:
        """``tensor``, which a live GPU or host allocation has (an NVMe one, or a freed one, has none)."""
        if self.tensor is None:
            raise RuntimeError(f"{self.key} has no tensor here: an NVMe allocation, or one already freed")
        return self.tensor

    def require_swap(self) -> SwapFile:
        """``swap``, which a live NVMe allocation has."""
        if self.swap is None:
            raise RuntimeError(f"{self.key} has no swap file here: not an NVMe allocation, or one already freed")
        return self.swap


class Tier(abc.ABC):
    """A place where bytes live, with a hard budget."""

    name: TierName

    @property
    @abc.abstractmethod
    def capacity_nbytes(self) -> int:
        """The budget in bytes."""

    @property
    @abc.abstractmethod
    def used_nbytes(self) -> int:
        """Bytes reserved now."""

    @property
    def free_nbytes(self) -> int:
        """Budget not reserved."""
        return self.capacity_nbytes - self.used_nbytes

    @abc.abstractmethod
    def allocate(self, key: TensorKey, meta: TensorMeta) -> Allocation:
        """Reserve room for key; raises CapacityError (reserving nothing) when it does not fit."""

    @abc.abstractmethod
    def free(self, allocation: Allocation) -> None:
        """Return an allocation's bytes."""

    def close(self) -> None:  # noqa: B027  # optional: the GPU tier holds nothing to release
        """Release the tier's resources."""


class GpuTier(Tier):
    """Device memory (the CPU stands in for it when there is no CUDA), accounted against a budget."""

    name = TierName.GPU

    def __init__(self, device: torch.device, budget_nbytes: int):
        self.device = device
        self._capacity = budget_nbytes
        self._used = 0
        self._lock = threading.Lock()
        self._cpu_cache: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    @property
    def capacity_nbytes(self) -> int:
        return self._capacity

    @property
    def used_nbytes(self) -> int:
        return self._used

    def allocate(self, key: TensorKey, meta: TensorMeta) -> Allocation:
        with self._lock:
            if self._used + meta.nbytes > self._capacity:
                raise CapacityError("gpu", meta.nbytes, self._used, self._capacity, str(key))
            self._used += meta.nbytes
        try:
            tensor = self._reuse(meta)
            if tensor is None:
                tensor = torch.empty(meta.numel, dtype=meta.dtype, device=self.device)
        except torch.OutOfMemoryError:
            with self._lock:
                self._used -= meta.nbytes
            raise
        return Allocation(key=key, meta=meta, reserved_nbytes=meta.nbytes, tensor=tensor)

    def free(self, allocation: Allocation) -> None:
        with self._lock:
            self._used -= allocation.reserved_nbytes
            if self.device.type == "cpu" and allocation.tensor is not None:
                self._cpu_cache.setdefault((allocation.meta.numel, allocation.meta.dtype), []).append(allocation.tensor)
        allocation.tensor = None

    def _reuse(self, meta: TensorMeta) -> torch.Tensor | None:
        """CPU stand-in only: a freed buffer of the same shape, as CUDA's caching allocator would hand back.
        Fresh host memory costs a page fault per 4 KiB on first write, which no GPU allocation pays."""
        if self.device.type != "cpu":
            return None
        with self._lock:
            cached = self._cpu_cache.get((meta.numel, meta.dtype))
            return cached.pop() if cached else None

    def reserve(self, nbytes: int, what: str) -> None:
        """Account nbytes of device memory that a caller allocates itself (e.g. block weights it resizes);
        raises CapacityError, reserving nothing, over budget."""
        with self._lock:
            if self._used + nbytes > self._capacity:
                raise CapacityError("gpu", nbytes, self._used, self._capacity, what)
            self._used += nbytes

    def unreserve(self, nbytes: int) -> None:
        """Return bytes accounted with reserve()."""
        with self._lock:
            if nbytes > self._used:
                raise RuntimeError(f"unreserve of {nbytes} bytes exceeds the {self._used} reserved on the gpu tier")
            self._used -= nbytes


class HostTier(Tier):
    """Sub-allocations of one pinned arena."""

    name = TierName.HOST

    def __init__(self, arena: PinnedArena):
        self.arena = arena

    @property
    def capacity_nbytes(self) -> int:
        return self.arena.capacity_nbytes

    @property
    def used_nbytes(self) -> int:
        return self.arena.used_nbytes

    def allocate(self, key: TensorKey, meta: TensorMeta) -> Allocation:
        offset = self.arena.allocate(meta.nbytes, what=str(key))
        return Allocation(
            key=key,
            meta=meta,
            reserved_nbytes=self.arena.reserved_size(meta.nbytes),
            tensor=self.arena.view(offset, meta.nbytes, meta.dtype),
            offset=offset,
        )

    def io_buffer(self, allocation: Allocation) -> torch.Tensor:
        """The allocation's bytes padded to the IO alignment, as uint8 (for O_DIRECT file IO)."""
        return self.arena.padded_view(allocation.offset, allocation.meta.nbytes)

    def free(self, allocation: Allocation) -> None:
        self.arena.free(allocation.offset)
        allocation.tensor = None

    def close(self) -> None:
        self.arena.close()


class NvmeTier(Tier):
    """One swap file per key in a locked directory."""

    name = TierName.NVME

    def __init__(self, directory: NVMeDirectory):
        self.directory = directory

    @property
    def capacity_nbytes(self) -> int:
        return self.directory.budget_nbytes

    @property
    def used_nbytes(self) -> int:
        return self.directory.used_nbytes

    def allocate(self, key: TensorKey, meta: TensorMeta) -> Allocation:
        swap = self.directory.create(key, meta)
        return Allocation(key=key, meta=meta, reserved_nbytes=swap.file_nbytes, swap=swap)

    def free(self, allocation: Allocation) -> None:
        self.directory.remove(allocation.key)
        allocation.swap = None

    def close(self) -> None:
        self.directory.close()


class Tiers(Mapping[TierName, Tier]):
    """A store's tiers by name: the GPU and host tiers always, the NVMe tier when configured. Looked up by a
    literal name, a tier has its own class (``tiers[TierName.HOST].arena`` type-checks); by any other name, ``Tier``.
    Like a dict keyed by ``TierName``, it also takes the names' values (``tiers["host"]``)."""

    def __init__(self, gpu: GpuTier, host: HostTier, nvme: NvmeTier | None = None):
        self.gpu, self.host, self.nvme = gpu, host, nvme
        self._by_name: dict[TierName, Tier] = {TierName.GPU: gpu, TierName.HOST: host}
        if nvme is not None:
            self._by_name[TierName.NVME] = nvme

    @overload
    def __getitem__(self, name: Literal[TierName.GPU]) -> GpuTier: ...
    @overload
    def __getitem__(self, name: Literal[TierName.HOST]) -> HostTier: ...
    @overload
    def __getitem__(self, name: Literal[TierName.NVME]) -> NvmeTier: ...
    @overload
    def __getitem__(self, name: TierName | str) -> Tier: ...
    def __getitem__(self, name: TierName | str) -> Tier:
        try:
            return self._by_name[TierName(name)]
        except ValueError:  # not a tier's name: a KeyError, as a dict says it (and Mapping's get / in expect)
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[TierName]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)
