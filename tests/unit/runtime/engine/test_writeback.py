"""DeviceWritebacks: a forward waits for the write-backs it needs the memory of, and for no others."""

from __future__ import annotations

import torch

from runtime.engine.writeback import FRAGMENTATION_MARGIN, DeviceWritebacks


class FakeMemory:
    """Device bytes in use: what the forward allocated plus what write-backs still hold."""

    def __init__(self) -> None:
        self.forward = 0
        self.held = 0

    def allocated(self) -> int:
        return self.forward + self.held


class FakeWriteback:
    def __init__(self, memory: FakeMemory, nbytes: int) -> None:
        self.memory, self.nbytes, self.landed, self.waited = memory, nbytes, False, False
        self.waited_at: int | None = None  # the forward's own bytes when it was waited for
        memory.held += nbytes

    def land(self) -> None:
        if not self.landed:
            self.landed = True
            self.memory.held -= self.nbytes
            for callback in getattr(self, "callbacks", []):
                callback(self)

    def add_done_callback(self, callback) -> None:
        if self.landed:
            callback(self)
        else:
            self.__dict__.setdefault("callbacks", []).append(callback)

    def done(self) -> bool:
        return self.landed

    def wait(self) -> FakeWriteback:
        self.waited = True
        self.waited_at = self.memory.forward
        self.land()
        return self


def _tracked(limit: int) -> tuple[FakeMemory, DeviceWritebacks]:
    """Fake device memory and the write-backs tracked against it, under an allocator limit of ``limit`` bytes."""
    memory = FakeMemory()
    return memory, DeviceWritebacks(torch.device("cuda"), limit_nbytes=limit, allocated=memory.allocated)


def _forward(writebacks: DeviceWritebacks, memory: FakeMemory, sizes: list[int], base: int = 100,
             order: list[int] | None = None) -> None:
    """One training forward over blocks 0.. (or ``order``) with the given activation sizes."""
    writebacks.forward_begin()
    memory.forward = base
    for index, size in zip(order or range(len(sizes)), sizes, strict=True):
        writebacks.before_forward(index)
        memory.forward += size
    writebacks.forward_end()


def test_forward_waits_for_the_oldest_write_backs_only_while_its_next_block_would_pass_the_limit() -> None:
    limit = 1000
    memory, writebacks = _tracked(limit)
    assert writebacks.limit_nbytes == int(limit * (1 - FRAGMENTATION_MARGIN))  # 970
    _forward(writebacks, memory, [200, 300])  # learns each block's growth; nothing in flight, nothing waited
    assert writebacks.waits == 0
    first, second = FakeWriteback(memory, 200), FakeWriteback(memory, 200)
    writebacks.add(first)  # type: ignore[arg-type]
    writebacks.add(second)  # type: ignore[arg-type]
    _forward(writebacks, memory, [200, 300])
    # block 0: 100 + 400 held + 200 = 700 fits; block 1: 300 + 400 + 300 = 1000 > 970 -> the oldest lands (800
    # fits); the other only before the backward
    assert first.waited_at == 300 and second.waited_at == 600
    assert writebacks.waits == 2


def test_write_backs_that_landed_meanwhile_are_not_waited_for_and_growth_excludes_held_bytes() -> None:
    memory, writebacks = _tracked(1000)
    early = FakeWriteback(memory, 500)
    writebacks.add(early)  # type: ignore[arg-type]
    _forward(writebacks, memory, [200, 300])  # no growth known yet: the forward never waits, the backward does
    assert early.waited_at == 600 and writebacks.waits == 1
    late = FakeWriteback(memory, 100)
    writebacks.add(late)  # type: ignore[arg-type]
    late.land()  # landed on its own: settle() observes it, nobody waits for it
    _forward(writebacks, memory, [200, 300])
    assert not late.waited and writebacks.waits == 1
    assert writebacks._growth == {(0, 0): 200, (1, 1): 300}  # learned with the 500 held bytes excluded


def test_off_cuda_nothing_is_tracked() -> None:
    writebacks = DeviceWritebacks(torch.device("cpu"))
    assert writebacks.limit_nbytes is None
    writebacks.forward_begin()
    writebacks.before_forward(0)
    writebacks.forward_end()
    assert writebacks.waits == 0


def test_the_backward_starts_after_every_write_back_landed() -> None:
    memory, writebacks = _tracked(10_000)
    pending = FakeWriteback(memory, 300)
    writebacks.add(pending)  # type: ignore[arg-type]
    _forward(writebacks, memory, [200, 300])  # plenty of room: the forward itself never waits
    assert pending.waited_at == 600 and writebacks.handles == [] and memory.held == 0  # at the end, not before


def test_a_block_used_twice_in_a_forward_keeps_each_use_s_growth() -> None:
    """Tied embedding and head: block 0 runs first (small) and last (the logits, large)."""
    memory, writebacks = _tracked(1000)
    _forward(writebacks, memory, [10, 200, 400], order=[0, 1, 0])
    pending = FakeWriteback(memory, 600)
    writebacks.add(pending)  # type: ignore[arg-type]
    _forward(writebacks, memory, [10, 200, 400], order=[0, 1, 0])
    # first use: 100 + 600 held + 10 fits (keyed by block alone it would have taken the head's 400: 1100);
    # at the head: 310 + 600 + 400 = 1310 > 970, waited there
    assert pending.waited_at == 310


def test_a_kept_source_lives_until_its_write_back_completes():
    # A held gradient's copy: nobody else holds the device tensor, so the tracker keeps it alive while in flight
    # and lets it go the moment the copy is seen complete (by anyone: the handle's completion callback).
    import weakref

    memory = FakeMemory()
    writebacks = DeviceWritebacks(torch.device("cpu"), limit_nbytes=100, allocated=memory.allocated)
    first, second = FakeWriteback(memory, 10), FakeWriteback(memory, 10)
    sources = [torch.zeros(4), torch.zeros(4)]
    alive = [weakref.ref(t) for t in sources]
    writebacks.add(first, keep=sources[0])
    writebacks.add(second, keep=sources[1])
    del sources
    writebacks.settle()
    assert alive[0]() is not None and alive[1]() is not None
    first.land()
    assert alive[0]() is None and alive[1]() is not None
    writebacks.wait_all()
    assert alive[1]() is None and writebacks.held_nbytes() == 0
    landed = FakeWriteback(memory, 10)
    landed.land()
    source = torch.zeros(4)
    kept = weakref.ref(source)
    writebacks.add(landed, keep=source)  # complete already: not tracked, nothing kept
    del source
    assert writebacks.handles == [] and kept() is None
