"""PinnedArena: exact budget, aligned sub-buffers that share the arena's memory, CUDA registration."""

from __future__ import annotations

import pytest
import torch

from tierstore import CapacityError, PinnedArena
from tierstore.pinned import IO_ALIGNMENT


def test_allocations_are_aligned_disjoint_and_share_the_arena() -> None:
    with PinnedArena(64 * 1024, pin=False) as arena:
        sizes = [1, 4097, 4096, 0, 10_000]
        offsets = [arena.allocate(n) for n in sizes]
        views = [arena.view(off, max(n, 1)) for off, n in zip(offsets, sizes, strict=True)]
        for i, (off, view) in enumerate(zip(offsets, views, strict=True)):
            assert off % IO_ALIGNMENT == 0 and view.data_ptr() % IO_ALIGNMENT == 0
            view.fill_(i + 1)
        for i, view in enumerate(views):  # no buffer was overwritten by another's fill
            assert bool((view == i + 1).all()), f"buffer {i} overlaps another"
        assert arena.used_nbytes == sum(arena.reserved_size(n) for n in sizes)
        assert arena.free_nbytes == arena.capacity_nbytes - arena.used_nbytes
        # The views are the arena's memory, not copies.
        arena.view(offsets[1], 8).copy_(torch.arange(8, dtype=torch.uint8))
        assert torch.equal(views[1][:8], torch.arange(8, dtype=torch.uint8))


def test_typed_and_padded_views() -> None:
    with PinnedArena(32 * 1024, pin=False) as arena:
        off = arena.allocate(4097 * 4)
        floats = arena.view(off, 4097 * 4, torch.float32)
        assert floats.dtype == torch.float32 and floats.numel() == 4097
        floats.copy_(torch.arange(4097, dtype=torch.float32))
        padded = arena.padded_view(off, 4097 * 4)
        assert padded.numel() == 5 * IO_ALIGNMENT
        assert torch.equal(padded[: 4097 * 4].view(torch.float32), torch.arange(4097, dtype=torch.float32))


def test_over_budget_raises_and_reserves_nothing() -> None:
    with PinnedArena(3 * IO_ALIGNMENT, pin=False, name="host") as arena:
        arena.allocate(2 * IO_ALIGNMENT)
        used = arena.used_nbytes
        with pytest.raises(CapacityError) as info:
            arena.allocate(IO_ALIGNMENT + 1, what="block.7/master")
        message = str(info.value)
        assert "host" in message and "block.7/master" in message and f"{2 * IO_ALIGNMENT:,}" in message
        assert info.value.requested_nbytes == 2 * IO_ALIGNMENT and info.value.capacity_nbytes == 3 * IO_ALIGNMENT
        assert arena.used_nbytes == used
        assert arena.allocate(IO_ALIGNMENT) == 2 * IO_ALIGNMENT  # what is left still works


def test_free_returns_bytes_and_double_free_raises() -> None:
    with PinnedArena(2 * IO_ALIGNMENT, pin=False) as arena:
        off = arena.allocate(2 * IO_ALIGNMENT)
        arena.free(off)
        assert arena.used_nbytes == 0
        with pytest.raises(RuntimeError, match="double free"):
            arena.free(off)
        assert arena.allocate(2 * IO_ALIGNMENT) == off


def test_zero_and_negative_capacity() -> None:
    with PinnedArena(0, pin=False) as arena:
        with pytest.raises(CapacityError):
            arena.allocate(0)
    with pytest.raises(ValueError, match=">= 0"):
        PinnedArena(-1, pin=False)


def test_closed_arena_refuses_use() -> None:
    arena = PinnedArena(IO_ALIGNMENT, pin=False)
    off = arena.allocate(16)
    arena.close()
    arena.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        arena.view(off, 16)
    with pytest.raises(RuntimeError, match="closed"):
        arena.allocate(16)


def test_without_cuda_the_arena_is_plain_memory() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback")
    with PinnedArena(IO_ALIGNMENT) as arena:
        assert arena.pinned is False
    with pytest.raises(ValueError, match="CUDA is not available"):
        PinnedArena(IO_ALIGNMENT, pin=True)


@pytest.mark.gpu
def test_arena_is_registered_with_cuda_and_unregistered_on_close() -> None:
    arena = PinnedArena(8 * IO_ALIGNMENT, pin=True)
    try:
        assert arena.pinned
        off = arena.allocate(3 * IO_ALIGNMENT)
        view = arena.view(off, 3 * IO_ALIGNMENT, torch.float32)
        assert view.is_pinned(), "cudaHostRegister did not make the arena page-locked"
        data = torch.randn(view.numel())
        view.copy_(data)
        on_gpu = view.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_gpu.cpu(), data)
        back = arena.view(arena.allocate(3 * IO_ALIGNMENT), 3 * IO_ALIGNMENT, torch.float32)
        back.copy_(on_gpu * 2, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, data * 2)
        del view, back
    finally:
        arena.close()
    assert not arena.pinned


@pytest.mark.gpu
def test_pin_false_with_cuda_is_not_registered() -> None:
    with PinnedArena(IO_ALIGNMENT, pin=False) as arena:
        assert not arena.pinned
        assert not arena.view(arena.allocate(16), 16).is_pinned()


def test_memory_the_machine_refuses_names_the_budget(monkeypatch) -> None:
    import errno
    import mmap

    from tierstore import HostMemoryError

    def refuse(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)  # as a 64 TiB arena is refused where the kernel does not overcommit
    with pytest.raises(HostMemoryError) as info:
        PinnedArena(64 << 40, pin=False)
    message = str(info.value)
    assert "could not map the host arena of 70,368,744,177,664 bytes" in message and "tiers.host.budget" in message


def test_state_packed_at_the_end_leaves_its_first_range_next_to_the_free_room() -> None:
    """Allocations made inside ``packed_at_end`` fill the arena's last bytes in order; afterwards first fit is plain
    again, and freeing the first packed allocation makes one range with the free room below it."""
    unit = IO_ALIGNMENT
    with PinnedArena(16 * unit + 100, pin=False) as arena:  # the odd tail is not usable
        with arena.packed_at_end(3 * unit):
            first, second = arena.allocate(unit), arena.allocate(2 * unit - 1)
        assert (first, second) == (13 * unit, 14 * unit)
        assert arena.allocate(unit) == 0
        arena.free(first)
        assert arena._allocator.largest_free_nbytes == 13 * unit  # [unit, 14 * unit)
        with arena.packed_at_end(64 * unit):  # more than the arena: plain first fit
            assert arena.allocate(unit) == unit
