"""RangeAllocator: aligned, non-overlapping ranges; first fit; freed neighbours coalesce back to one range."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierstore.allocator import RangeAllocator, align_up

UNIT = 64  # a small alignment keeps the model (one cell per unit) cheap


def _free_ranges(alloc: RangeAllocator) -> list[tuple[int, int]]:
    return list(zip(alloc._free_starts, alloc._free_ends, strict=True))


def _check_tiling(alloc: RangeAllocator) -> None:
    """Allocated and free ranges are aligned, disjoint, sorted, non-adjacent (free) and tile [0, usable)."""
    usable = alloc.capacity_nbytes - alloc.capacity_nbytes % alloc.alignment
    free = _free_ranges(alloc)
    for (_, e0), (s1, _) in zip(free, free[1:], strict=False):  # each range and the next
        assert e0 < s1, f"free ranges {free} overlap, touch (not coalesced) or are unsorted"
    pieces = sorted([(s, e, "free") for s, e in free] + [(o, o + n, "used") for o, n in alloc._allocated.items()])
    pos = 0
    for start, end, _ in pieces:
        assert start == pos, f"gap or overlap at {pos}: {pieces}"
        assert start % alloc.alignment == 0 and end % alloc.alignment == 0 and end > start
        pos = end
    assert pos == usable, f"ranges cover [0, {pos}), expected [0, {usable})"
    assert alloc.used_nbytes == sum(alloc._allocated.values())


def test_align_up() -> None:
    assert [align_up(v, 4096) for v in (0, 1, 4095, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]


@pytest.mark.parametrize("alignment", [0, -4096, 3, 4095])
def test_alignment_must_be_a_power_of_two(alignment: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        RangeAllocator(1 << 20, alignment)


def test_reserved_size_rounds_up_and_zero_reserves_one_unit() -> None:
    alloc = RangeAllocator(1 << 20, 4096)
    assert alloc.reserved_size(0) == 4096
    assert alloc.reserved_size(1) == 4096
    assert alloc.reserved_size(4097) == 8192


def test_capacity_not_a_multiple_of_alignment_uses_whole_units_only() -> None:
    alloc = RangeAllocator(3 * 4096 + 100, 4096)
    assert alloc.largest_free_nbytes == 3 * 4096
    assert alloc.allocate(3 * 4096 + 1) is None
    assert alloc.allocate(3 * 4096) == 0
    assert alloc.allocate(1) is None


def test_zero_capacity_allocates_nothing() -> None:
    alloc = RangeAllocator(0, 4096)
    assert alloc.allocate(0) is None
    assert alloc.largest_free_nbytes == 0 and alloc.used_nbytes == 0


def test_failed_allocation_reserves_nothing() -> None:
    alloc = RangeAllocator(4 * UNIT, UNIT)
    assert alloc.allocate(3 * UNIT) == 0
    before = (_free_ranges(alloc), dict(alloc._allocated))
    assert alloc.allocate(2 * UNIT) is None
    assert (_free_ranges(alloc), dict(alloc._allocated)) == before


def test_double_free_and_unknown_offset_raise() -> None:
    alloc = RangeAllocator(4 * UNIT, UNIT)
    off = alloc.allocate(UNIT)
    alloc.free(off)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(off)
    with pytest.raises(RuntimeError, match="not allocated"):
        alloc.free(UNIT)


def test_first_fit_reuses_the_lowest_hole() -> None:
    alloc = RangeAllocator(8 * UNIT, UNIT)
    offsets = [alloc.allocate(UNIT) for _ in range(4)]
    alloc.free(offsets[1])
    alloc.free(offsets[2])
    assert alloc.allocate(2 * UNIT) == offsets[1]  # the coalesced hole, not the tail


def test_a_floor_packs_allocations_above_it_and_falls_back_below() -> None:
    """With a floor, allocations fill from it upwards in order; one that finds no room above goes first fit below;
    without the floor, plain first fit again. Freeing the first allocation above the floor joins the room below."""
    alloc = RangeAllocator(10 * UNIT, UNIT)
    alloc.set_floor(6 * UNIT)
    assert [alloc.allocate(UNIT), alloc.allocate(2 * UNIT)] == [6 * UNIT, 7 * UNIT]
    assert alloc.could_place([UNIT, 2 * UNIT]) and not alloc.could_place([UNIT, 2 * UNIT, 5 * UNIT])
    assert alloc.allocate(2 * UNIT) == 0  # one unit left above: below
    assert _free_ranges(alloc) == [(2 * UNIT, 6 * UNIT), (9 * UNIT, 10 * UNIT)]
    alloc.set_floor(0)
    assert alloc.allocate(UNIT) == 2 * UNIT
    alloc.free(6 * UNIT)
    assert _free_ranges(alloc) == [(3 * UNIT, 7 * UNIT), (9 * UNIT, 10 * UNIT)]
    _check_tiling(alloc)


def test_every_free_order_coalesces_to_one_range() -> None:
    """Exhaustive over the 5! orders of freeing five ranges of different sizes (holes in every position)."""
    sizes = [1, 3, 2, 1, 2]
    capacity = (sum(sizes) + 1) * UNIT  # a free tail too, so the last range coalesces with it
    for order in itertools.permutations(range(len(sizes))):
        alloc = RangeAllocator(capacity, UNIT)
        offsets = [alloc.allocate(n * UNIT) for n in sizes]
        assert None not in offsets
        for i in order:
            alloc.free(offsets[i])
            _check_tiling(alloc)
        assert _free_ranges(alloc) == [(0, capacity)], f"order {order} left {_free_ranges(alloc)}"
        assert alloc.used_nbytes == 0 and alloc.largest_free_nbytes == capacity


def test_random_sequences_never_overlap() -> None:
    rng = random.Random(1234)
    for _ in range(30):
        alloc = RangeAllocator(rng.randrange(1, 40) * UNIT + rng.randrange(UNIT), UNIT)
        live: dict[int, int] = {}
        for _ in range(60):
            if live and rng.random() < 0.45:
                off = rng.choice(sorted(live))
                alloc.free(off)
                del live[off]
            else:
                nbytes = rng.randrange(0, 6 * UNIT)
                off = alloc.allocate(nbytes)
                if off is not None:
                    live[off] = nbytes
            _check_tiling(alloc)
        for off in list(live):
            alloc.free(off)
        _check_tiling(alloc)
        assert len(_free_ranges(alloc)) == (1 if alloc.capacity_nbytes >= UNIT else 0)


class AllocatorMachine(RuleBasedStateMachine):
    """Checks the allocator against a model: one cell per alignment unit, first fit by scanning."""

    NUM_UNITS = 24

    def __init__(self) -> None:
        super().__init__()
        self.alloc = RangeAllocator(self.NUM_UNITS * UNIT + 7, UNIT)
        self.cells = [False] * self.NUM_UNITS
        self.live: dict[int, int] = {}  # offset -> units
        self.floor = 0  # in units

    def _model_first_fit(self, units: int) -> int | None:
        for floor in (self.floor, 0):
            run = 0
            for i, used in enumerate(self.cells[floor:], start=floor):
                run = 0 if used else run + 1
                if run == units:
                    return (i - units + 1) * UNIT
        return None

    @rule(units=st.integers(min_value=0, max_value=NUM_UNITS + 2))
    def set_floor(self, units: int) -> None:
        self.alloc.set_floor(units * UNIT - (UNIT // 2 if units else 0))  # rounded up to the unit
        self.floor = min(units, self.NUM_UNITS)

    @rule(nbytes=st.integers(min_value=0, max_value=8 * UNIT))
    def allocate(self, nbytes: int) -> None:
        units = max(1, -(-nbytes // UNIT))
        expected = self._model_first_fit(units)
        got = self.alloc.allocate(nbytes)
        assert got == expected, f"allocate({nbytes}) gave {got}, first fit is {expected}"
        if got is not None:
            first = got // UNIT
            assert not any(self.cells[first : first + units]), "allocation overlaps a live range"
            self.cells[first : first + units] = [True] * units
            self.live[got] = units

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.live)))
        self.alloc.free(off)
        units = self.live.pop(off)
        self.cells[off // UNIT : off // UNIT + units] = [False] * units

    @rule()
    def free_everything(self) -> None:
        for off in list(self.live):
            self.free_one(off)
        assert _free_ranges(self.alloc) == [(0, self.NUM_UNITS * UNIT)]

    def free_one(self, off: int) -> None:
        self.alloc.free(off)
        units = self.live.pop(off)
        self.cells[off // UNIT : off // UNIT + units] = [False] * units

    @rule(sizes=st.lists(st.integers(min_value=1, max_value=8 * UNIT), max_size=5))
    def could_place_predicts_the_allocations(self, sizes: list[int]) -> None:
        predicted = self.alloc.could_place(sizes)
        made = [self.alloc.allocate(n) for n in sizes]
        assert predicted == all(off is not None for off in made), (sizes, _free_ranges(self.alloc))
        for off in made:  # nothing kept: the model's cells are unchanged
            if off is not None:
                self.alloc.free(off)

    @invariant()
    def consistent(self) -> None:
        _check_tiling(self.alloc)
        assert self.alloc.used_nbytes == sum(self.live.values()) * UNIT
        longest = max((len(list(g)) for used, g in itertools.groupby(self.cells) if not used), default=0)
        assert self.alloc.largest_free_nbytes == longest * UNIT


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
