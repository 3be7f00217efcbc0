"""One pre-sized host arena, pinned once at start and sub-allocated into block buffers.

Why not ``torch.empty(..., pin_memory=True)`` per buffer: pinning costs ~0.6 s per GiB, so it must happen
once, and torch's caching host allocator rounds every request up to a power of two (a 9 GiB request pins
16 GiB). We map exactly the bytes asked for (page-aligned anonymous memory, so sub-buffers can be used for
O_DIRECT) and register them with CUDA. Without CUDA the arena is ordinary host memory with the same API.
"""

from __future__ import annotations

import errno
import logging
import mmap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tierstore.allocator import RangeAllocator
from tierstore.errors import CapacityError, HostMemoryError

log = logging.getLogger(__name__)

IO_ALIGNMENT = 4096
CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation


class PinnedArena:
    """Exactly ``capacity_nbytes`` of host memory, page-locked when ``pin`` and CUDA is available.

    ``allocate(nbytes)`` returns an offset; ``view(offset, nbytes, dtype)`` a tensor over those bytes.
    The budget is hard: an allocation that does not fit raises CapacityError and reserves nothing.
    """

    def __init__(self, capacity_nbytes: int, pin: bool | None = None, name: str = "host"):
        if capacity_nbytes < 0:
            raise ValueError(f"host arena size must be >= 0, got {capacity_nbytes}")
        self.name = name
        self.capacity_nbytes = capacity_nbytes
        self._allocator = RangeAllocator(capacity_nbytes, IO_ALIGNMENT)
        want_pin = torch.cuda.is_available() if pin is None else pin
        if want_pin and not torch.cuda.is_available():
            raise ValueError("pinned host memory was asked for (pin: true) but CUDA is not available; use pin: auto")
        # mmap gives page-aligned memory of exactly the requested size (length 0 is not allowed by mmap).
        try:
            self._mmap = mmap.mmap(-1, max(capacity_nbytes, IO_ALIGNMENT), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
            raise HostMemoryError(capacity_nbytes, "map", f"{exc.strerror} (ENOMEM)") from None
        self._buffer = (torch.frombuffer(self._mmap, dtype=torch.uint8, count=capacity_nbytes) if capacity_nbytes
                        else torch.empty(0, dtype=torch.uint8))
        self.pinned = False
        self._closed = False
        self._lock = threading.Lock()
        if want_pin and capacity_nbytes:
            self._register()

    def _register(self) -> None:
        started = time.perf_counter()
        # Touch every page first: registration of untouched anonymous memory faults it in anyway, and doing
        # it here keeps the cost visible in one place.
        self._buffer.zero_()
        result = torch.cuda.cudart().cudaHostRegister(self._buffer.data_ptr(), self.capacity_nbytes, 0)
        if int(result) == CUDA_ERROR_MEMORY_ALLOCATION:  # the locked-memory limit, or RAM itself, is short
            raise HostMemoryError(self.capacity_nbytes, "page-lock (cudaHostRegister)", "cudaErrorMemoryAllocation")
        if int(result) != 0:
            raise RuntimeError(f"cudaHostRegister of {self.capacity_nbytes:,} bytes failed with CUDA error {int(result)}")
        self.pinned = True
        elapsed = time.perf_counter() - started
        log.info("pinned %.2f GiB of host memory in %.2f s", self.capacity_nbytes / 2**30, elapsed)

    @property
    def used_nbytes(self) -> int:
        """Bytes reserved by live allocations (alignment included)."""
        return self._allocator.used_nbytes

    @property
    def free_nbytes(self) -> int:
        """Budget not yet reserved."""
        return self.capacity_nbytes - self.used_nbytes

    def reserved_size(self, nbytes: int) -> int:
        """Bytes an allocation of nbytes would reserve."""
        return self._allocator.reserved_size(nbytes)

    def could_place(self, sizes: list[int]) -> bool:
        """Whether allocations of these sizes, made now in this order, would all fit (nothing is reserved)."""
        return self._allocator.could_place(sizes)

    def allocate(self, nbytes: int, what: str = "buffer") -> int:
        """Reserve nbytes (4096-aligned); raises CapacityError when the budget or a contiguous range is short."""
        self._check_open()
        offset = self._allocator.allocate(nbytes)
        if offset is None:
            raise CapacityError(self.name, self._allocator.reserved_size(nbytes), self.used_nbytes, self.capacity_nbytes, what)
        return offset

    def free(self, offset: int) -> None:
        """Return an allocation to the arena."""
        self._allocator.free(offset)

    @contextmanager
    def packed_at_end(self, nbytes: int) -> Iterator[None]:
        """Allocations made inside (``nbytes`` reserved in all, alignment included) fill the arena's last ``nbytes``
        in the order they are made, so the arena's free room lies below the first of them: when the first ones are
        freed, their room and the free room are one range. Why: a placement that moves the first blocks' state to
        the GPU between steps frees it, and what comes back in its place (spilled moments, ``runtime.engine.spill_return``)
        needs ranges, not bytes. An allocation that finds no room up there is placed first fit below. The floor is
        the arena's, not the caller's: any thread's allocation inside is packed too, and it does not nest."""
        self._allocator.set_floor(self.capacity_nbytes - nbytes - self.capacity_nbytes % IO_ALIGNMENT)
        try:
            yield
        finally:
            self._allocator.set_floor(0)

    def view(self, offset: int, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A flat tensor of dtype over [offset, offset + nbytes) of the arena (shares memory)."""
        self._check_open()
        raw = self._buffer[offset : offset + nbytes]
        return raw.view(dtype) if dtype != torch.uint8 else raw

    def padded_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The bytes of an allocation rounded up to the IO alignment (what O_DIRECT reads and writes)."""
        return self.view(offset, self._allocator.reserved_size(nbytes))

    def close(self) -> None:
        """Unregister and unmap. Views handed out before must not be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.pinned:
                torch.cuda.cudart().cudaHostUnregister(self._buffer.data_ptr())
                self.pinned = False
            self._buffer = torch.empty(0, dtype=torch.uint8)
            try:
                self._mmap.close()
            except BufferError:
                # A view is still alive somewhere; the mapping goes when the last reference does.
                log.debug("host arena still referenced at close; unmapping deferred")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} arena is closed")

    def __enter__(self) -> PinnedArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
