"""A first-fit range allocator over [0, capacity): the bookkeeping behind the pinned arena. A floor, while set,
makes first fit look at or above it first (how the arena packs state at its end: ``PinnedArena.packed_at_end``).

Pure logic (no memory is touched), so it is tested exhaustively on its own. Offsets and sizes are rounded
up to ``alignment`` so that every sub-buffer can be used for O_DIRECT IO.
"""

from __future__ import annotations

import bisect
import threading


def align_up(value: int, alignment: int) -> int:
    """The smallest multiple of alignment that is >= value."""
    return (value + alignment - 1) // alignment * alignment


class RangeAllocator:
    """Hands out aligned, non-overlapping [offset, offset + size) ranges; freed neighbours coalesce."""

    def __init__(self, capacity_nbytes: int, alignment: int = 4096):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.capacity_nbytes = capacity_nbytes
        self.alignment = alignment
        # Sorted, disjoint, non-adjacent free ranges as parallel lists of starts and ends.
        usable = capacity_nbytes - capacity_nbytes % alignment
        self._free_starts: list[int] = [0] if usable > 0 else []
        self._free_ends: list[int] = [usable] if usable > 0 else []
        self._allocated: dict[int, int] = {}  # offset -> reserved size
        # Allocations try the free room at or above this offset first (0: plain first fit): ``PinnedArena.packed_at_end``.
        self._floor = 0
        self._lock = threading.Lock()

    @property
    def used_nbytes(self) -> int:
        """Bytes reserved, alignment padding included."""
        with self._lock:
            return sum(self._allocated.values())

    @property
    def largest_free_nbytes(self) -> int:
        """The largest single range that could be allocated now."""
        with self._lock:
            return max((e - s for s, e in zip(self._free_starts, self._free_ends, strict=True)), default=0)

    def reserved_size(self, nbytes: int) -> int:
        """How many bytes an allocation of nbytes reserves."""
        return align_up(max(nbytes, 1), self.alignment)

    def set_floor(self, offset: int) -> None:
        """Place later allocations first fit among the free room at or above ``offset`` (rounded up to the alignment),
        and first fit below it only where that room has no range large enough; 0 restores plain first fit."""
        with self._lock:
            self._floor = align_up(max(offset, 0), self.alignment)

    def could_place(self, sizes: list[int]) -> bool:
        """Whether allocations of these sizes, made now in this order, would all succeed (placed as ``allocate``
        places them; nothing is reserved)."""
        with self._lock:
            starts, ends = list(self._free_starts), list(self._free_ends)
            for nbytes in sizes:
                size = self.reserved_size(nbytes)
                found = self._find(starts, ends, size)
                if found is None:
                    return False
                _cut(starts, ends, *found, size)
        return True

    def allocate(self, nbytes: int) -> int | None:
        """Reserve nbytes (rounded up); returns the offset, or None when no free range is large enough."""
        size = self.reserved_size(nbytes)
        with self._lock:
            found = self._find(self._free_starts, self._free_ends, size)
            if found is None:
                return None
            _cut(self._free_starts, self._free_ends, *found, size)
            self._allocated[found[1]] = size
            return found[1]

    def _find(self, starts: list[int], ends: list[int], size: int) -> tuple[int, int] | None:
        """Where first fit puts size bytes among these free ranges: (the range's position, the offset); at or above
        the floor when it has room there, else anywhere."""
        for floor in (self._floor, 0) if self._floor else (0,):
            for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
                begin = max(start, floor)
                if end - begin >= size:
                    return i, begin
        return None

    def free(self, offset: int) -> None:
        """Return a range; raises RuntimeError on a double free or an unknown offset."""
        with self._lock:
            size = self._allocated.pop(offset, None)
            if size is None:
                raise RuntimeError(f"free of offset {offset} that is not allocated (double free?)")
            start, end = offset, offset + size
            i = bisect.bisect_left(self._free_starts, start)
            # Coalesce with the previous and next free ranges where they touch.
            if i > 0 and self._free_ends[i - 1] == start:
                i -= 1
                start = self._free_starts[i]
                del self._free_starts[i]
                del self._free_ends[i]
            if i < len(self._free_starts) and self._free_starts[i] == end:
                end = self._free_ends[i]
                del self._free_starts[i]
                del self._free_ends[i]
            self._free_starts.insert(i, start)
            self._free_ends.insert(i, end)


def _cut(starts: list[int], ends: list[int], i: int, begin: int, size: int) -> None:
    """Take [begin, begin + size) out of free range i of these parallel lists: what is left of it on either side
    stays free."""
    left = [(a, b) for a, b in ((starts[i], begin), (begin + size, ends[i])) if b > a]
    starts[i : i + 1] = [a for a, _ in left]
    ends[i : i + 1] = [b for _, b in left]
