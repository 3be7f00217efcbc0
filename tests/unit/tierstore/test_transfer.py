"""TransferEngine and Handle: every copy bit-exact, one event per completed transfer, wait/done semantics."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.unit.tierstore.tensors import as_bytes, random_tensor
from tierstore import EventBus, NVMeDirectory, PinnedArena, TransferEngine, TransferEvent
from tierstore.keys import TensorKey, TensorMeta
from tierstore.transfer import Handle, _Pacer, done_handle


class Recorder:
    def __init__(self, bus: EventBus) -> None:
        self.events: list[TransferEvent] = []
        self._lock = threading.Lock()
        bus.subscribe(self)

    def __call__(self, event: TransferEvent) -> None:
        with self._lock:
            self.events.append(event)

    def moved(self, kind: str) -> int:
        return sum(e.nbytes for e in self.events if e.kind == kind)


@pytest.fixture
def engine(device: torch.device):
    eng = TransferEngine(device, io_threads=2)
    yield eng
    eng.close()


def manual_handle() -> Handle:
    """A handle the test completes by hand, to hold a dependent transfer back."""
    return Handle("copy", "gate", "host", "host", 0, None)


# ---- host <-> device --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool], ids=str)
@pytest.mark.parametrize("numel", [0, 1, 4097, (1 << 20) + 1])
def test_h2d_d2h_round_trip(engine: TransferEngine, device: torch.device, dtype: torch.dtype, numel: int) -> None:
    recorder = Recorder(engine.bus)
    data = random_tensor(dtype, numel, seed=numel)
    on_device = torch.empty(numel, dtype=dtype, device=device)
    back = torch.empty(numel, dtype=dtype)
    up = engine.h2d("k", data, on_device)
    down = engine.d2h("k", on_device, back, after=up)
    assert down.wait() is down and up.done() and down.done()
    assert torch.equal(as_bytes(back), as_bytes(data))
    nbytes = numel * data.element_size()
    assert [(e.kind, e.src_tier, e.dst_tier, e.nbytes) for e in recorder.events] == [
        ("h2d", "host", "gpu", nbytes),
        ("d2h", "gpu", "host", nbytes),
    ]
    assert all(e.end_s >= e.start_s and e.duration_s >= 0 for e in recorder.events)


def test_copy_shape_or_dtype_mismatch_is_refused(engine: TransferEngine, device: torch.device) -> None:
    with pytest.raises(ValueError, match="does not match"):
        engine.h2d("k", torch.zeros(4), torch.zeros(5, device=device))
    with pytest.raises(ValueError, match="does not match"):
        engine.d2h("k", torch.zeros(4, device=device), torch.zeros(4, dtype=torch.float64))


def test_dependent_copy_waits_for_its_predecessor(engine: TransferEngine, device: torch.device) -> None:
    gate = manual_handle()
    data = random_tensor(torch.float32, 1000)
    dst = torch.zeros(1000, device=device)
    handle = engine.h2d("k", data, dst, after=gate)
    assert not handle.done()
    assert bool((dst == 0).all())  # not issued yet
    gate._set_issued()
    gate._finish()
    handle.wait()
    assert torch.equal(as_bytes(dst), as_bytes(data))


def test_failed_predecessor_fails_the_dependent_copy(engine: TransferEngine, device: torch.device) -> None:
    recorder = Recorder(engine.bus)
    gate = manual_handle()
    dst = torch.zeros(10, device=device)
    handle = engine.h2d("k", torch.ones(10), dst, after=gate)
    gate._fail(OSError(5, "staging read failed"))
    with pytest.raises(OSError, match="staging read failed"):
        handle.wait()
    assert handle.done() and isinstance(handle.error, OSError)
    assert bool((dst == 0).all()) and recorder.events == []  # no copy, no event for a failed transfer
    already_failed = engine.h2d("k", torch.ones(10), dst, after=gate)
    with pytest.raises(OSError):
        already_failed.wait()


# ---- host <-> file ----------------------------------------------------------------------------------------
def test_file_write_then_read(engine: TransferEngine, nvme_dir: Path) -> None:
    recorder = Recorder(engine.bus)
    data = random_tensor(torch.bfloat16, 12345, seed=1)
    meta = TensorMeta.of(data)
    directory = NVMeDirectory(nvme_dir, 1 << 20)
    arena = PinnedArena(2 * 32768, pin=False)
    try:
        swap = directory.create(TensorKey("w"), meta)
        src = arena.padded_view(arena.allocate(meta.nbytes), meta.nbytes)
        dst = arena.padded_view(arena.allocate(meta.nbytes), meta.nbytes)
        src[: meta.nbytes].copy_(as_bytes(data))
        gate = manual_handle()
        write = engine.write("w", directory, swap, src, step=3, after=gate)
        assert not write.done()
        gate._set_issued()
        gate._finish()
        write.wait()
        read = engine.read("w", directory, swap, dst).wait()
        assert torch.equal(dst[: meta.nbytes], as_bytes(data)) and read.done()
        assert directory.read_step(swap) == 3
        assert [(e.kind, e.src_tier, e.dst_tier, e.nbytes) for e in recorder.events] == [
            ("write", "host", "nvme", meta.nbytes),
            ("read", "nvme", "host", meta.nbytes),
        ]
        assert all(e.thread.startswith("tierstore-io") for e in recorder.events)
    finally:
        directory.close()
        arena.close()


def test_io_error_surfaces_through_wait(engine: TransferEngine, nvme_dir: Path) -> None:
    recorder = Recorder(engine.bus)
    directory = NVMeDirectory(nvme_dir, 1 << 20)
    try:
        swap = directory.create(TensorKey("never_written"), TensorMeta(torch.float32, 8))
        handle = engine.read("never_written", directory, swap, torch.empty(32, dtype=torch.uint8))
        with pytest.raises(Exception, match="corrupt"):
            handle.wait()
        assert handle.done() and recorder.events == []
        gate = manual_handle()
        write = engine.write("never_written", directory, swap, torch.zeros(32, dtype=torch.uint8), after=gate)
        gate._fail(RuntimeError("upstream failed"))
        with pytest.raises(RuntimeError, match="upstream failed"):
            write.wait()
    finally:
        directory.close()


def test_closed_engine_fails_new_io(device: torch.device, nvme_dir: Path) -> None:
    eng = TransferEngine(device)
    eng.close()
    eng.close()  # idempotent
    directory = NVMeDirectory(nvme_dir, 1 << 20)
    try:
        swap = directory.create(TensorKey("late"), TensorMeta(torch.uint8, 8))
        with pytest.raises(RuntimeError, match="closed"):
            eng.read("late", directory, swap, torch.empty(8, dtype=torch.uint8)).wait()
    finally:
        directory.close()


def test_io_threads_must_be_positive(device: torch.device) -> None:
    with pytest.raises(ValueError, match="io_threads"):
        TransferEngine(device, io_threads=0)


# ---- handle semantics -------------------------------------------------------------------------------------
def test_done_handle() -> None:
    handle = done_handle("k", "gpu")
    assert handle.done() and handle.wait() is handle and handle.nbytes == 0 and handle.error is None
    seen = []
    handle.add_done_callback(seen.append)
    assert seen == [handle]


def test_callbacks_run_once_in_order() -> None:
    handle = manual_handle()
    seen: list[str] = []
    handle.add_done_callback(lambda h: seen.append("a"))
    handle.add_done_callback(lambda h: seen.append("b"))
    assert not handle.done() and seen == []
    handle._set_issued()
    assert handle.done()
    handle.wait()
    handle.done()
    assert seen == ["a", "b"]
    handle.add_done_callback(lambda h: seen.append("late"))  # already complete: runs at once
    assert seen == ["a", "b", "late"]


def test_failing_callback_does_not_break_the_handle(caplog: pytest.LogCaptureFixture) -> None:
    handle = manual_handle()
    seen = []
    handle.add_done_callback(lambda h: 1 / 0)
    handle.add_done_callback(seen.append)
    handle._set_issued()
    handle.wait()
    assert seen == [handle] and "callback failed" in caplog.text


def test_wait_returns_only_after_events_and_callbacks_ran(engine: TransferEngine, nvme_dir: Path) -> None:
    """Another thread finishes the transfer while a slow listener holds it up: done() must say False and
    wait() must not return until the listener and every completion callback have run (the store settles
    its states in those callbacks, so returning early lets a caller see LOADING or free memory twice)."""
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow_listener(event: TransferEvent) -> None:
        entered.set()
        release.wait(timeout=30)
        calls.append("listener")

    engine.bus.subscribe(slow_listener)
    directory = NVMeDirectory(nvme_dir, 1 << 20)
    try:
        swap = directory.create(TensorKey("slow"), TensorMeta(torch.uint8, 64))
        handle = engine.write("slow", directory, swap, torch.zeros(64, dtype=torch.uint8))
        handle.add_done_callback(lambda h: calls.append("callback"))
        assert entered.wait(timeout=30)  # the IO worker is now finishing the handle
        assert not handle.done()
        timer = threading.Timer(0.2, release.set)
        timer.start()
        handle.wait()
        assert calls == ["listener", "callback"]
        timer.join()
    finally:
        release.set()
        directory.close()


# ---- CUDA streams ------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_stream_copies_from_pinned_arena_are_exact_and_timed() -> None:
    device = torch.device("cuda")
    engine = TransferEngine(device)
    recorder = Recorder(engine.bus)
    nbytes = 8 << 20
    arena = PinnedArena(2 * nbytes, pin=True)
    try:
        assert arena.pinned
        data = torch.randn(nbytes // 2, generator=torch.Generator().manual_seed(5)).bfloat16()  # finite: doubled below
        host_in = arena.view(arena.allocate(nbytes), nbytes, torch.bfloat16)
        host_out = arena.view(arena.allocate(nbytes), nbytes, torch.bfloat16)
        host_in.copy_(data)
        on_gpu = torch.empty_like(data, device=device)
        up = engine.h2d("k", host_in, on_gpu)
        up.wait_stream()  # the current stream now runs after the copy, without a host wait
        doubled = on_gpu * 2  # produced on the current stream
        down = engine.d2h("k", doubled, host_out)  # must be ordered after that kernel
        del doubled  # record_stream keeps its memory until the copy is done
        torch.cuda.empty_cache()
        down.wait()
        assert torch.equal(host_out, data * 2)
        assert up.done()  # wait_stream() does not observe completion; done()/wait() publish the event
        assert sorted((e.kind, e.nbytes) for e in recorder.events) == [("d2h", nbytes), ("h2d", nbytes)]
        assert all(e.device_s is not None and e.device_s > 0 and e.duration_s == e.device_s for e in recorder.events)
        engine.synchronize()
    finally:
        engine.close()
        arena.close()


@pytest.mark.gpu
def test_device_copy_after_file_read_uses_the_staged_bytes(tmpfs_dir: Path) -> None:
    device = torch.device("cuda")
    engine = TransferEngine(device)
    data = random_tensor(torch.float32, 300_001, seed=9)
    meta = TensorMeta.of(data)
    directory = NVMeDirectory(tmpfs_dir, 4 << 20)
    arena = PinnedArena(2 << 20, pin=True)
    try:
        swap = directory.create(TensorKey("staged"), meta)
        staging = arena.padded_view(arena.allocate(meta.nbytes), meta.nbytes)
        staging[: meta.nbytes].copy_(as_bytes(data))
        directory.write(swap, staging)
        staging.zero_()
        read = engine.read("staged", directory, swap, staging)
        on_gpu = torch.empty(meta.numel, device=device)
        up = engine.h2d("staged", staging[: meta.nbytes].view(torch.float32), on_gpu, after=read)
        up.wait()
        assert torch.equal(as_bytes(on_gpu), as_bytes(data))
    finally:
        engine.close()
        directory.close()
        arena.close()


# ---- paced write-backs -------------------------------------------------------------------------------------
class _FakeCopyEvent:
    """Stands in for a copy's CUDA end event: 'completes' when the test releases it."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def query(self) -> bool:
        return self.released.is_set()


def test_pacer_issues_in_order_and_keeps_at_most_its_bytes_in_flight() -> None:
    pacer = _Pacer(torch.device("cpu"), in_flight_nbytes=100)
    issued: list[int] = []
    events: list[_FakeCopyEvent] = []
    lock = threading.Lock()
    try:
        for i, nbytes in enumerate([60, 30, 50, 200, 10]):
            handle = Handle("d2h", f"k{i}", "gpu", "host", nbytes, None)
            event = _FakeCopyEvent()
            events.append(event)

            def issue(i: int = i, handle: Handle = handle, event: _FakeCopyEvent = event) -> None:
                with lock:
                    issued.append(i)
                handle._set_issued(end_event=event)  # type: ignore[arg-type]

            pacer.submit(handle, issue)

        def issued_now() -> list[int]:
            with lock:
                return list(issued)

        def settle_on(expected: list[int]) -> None:
            for _ in range(1000):
                if issued_now() == expected:
                    return
                threading.Event().wait(0.005)
            assert issued_now() == expected

        settle_on([0, 1])  # 60 + 30 fit in 100; + 50 would not
        threading.Event().wait(0.05)
        assert issued_now() == [0, 1]  # still held back while copy 0 is in flight
        events[0].released.set()
        settle_on([0, 1, 2])  # 30 + 50 in flight
        events[1].released.set()
        events[2].released.set()
        settle_on([0, 1, 2, 3])  # 200 bytes: alone, larger than the limit
        events[3].released.set()
        settle_on([0, 1, 2, 3, 4])
    finally:
        for event in events:
            event.released.set()
        pacer.close()


def test_pacer_issues_every_queued_copy_at_close() -> None:
    pacer = _Pacer(torch.device("cpu"), in_flight_nbytes=1)
    handles = []
    for i in range(4):
        handle = Handle("d2h", f"k{i}", "gpu", "host", 8, None)
        event = _FakeCopyEvent()
        event.released.set()
        pacer.submit(handle, lambda handle=handle, event=event: handle._set_issued(end_event=event))  # type: ignore[misc]
        handles.append(handle)
    pacer.close()
    assert all(h._issued.is_set() for h in handles)
    late = Handle("d2h", "late", "gpu", "host", 8, None)
    pacer.submit(late, lambda: late._set_issued())  # after close: issued at once, on the caller's thread
    assert late._issued.is_set()


@pytest.mark.gpu
def test_a_device_to_host_copy_does_not_wait_for_queued_paced_write_backs() -> None:
    """The user's loss.item() after optimizer.step(): a small copy on the compute stream completes while most
    of a 2 GiB paced write-back is still queued (unpaced, the copy engine would serve it after all of it)."""
    device = torch.device("cuda")
    engine = TransferEngine(device)
    pieces, piece_numel = 16, 32 << 20  # 16 x 128 MiB of fp32
    arena = PinnedArena(pieces * piece_numel * 4, pin=True)
    try:
        sources = [torch.full((piece_numel,), float(i), device=device) for i in range(pieces)]
        targets = [arena.view(arena.allocate(piece_numel * 4), piece_numel * 4, torch.float32) for _ in range(pieces)]
        torch.cuda.synchronize()
        handles = [engine.d2h(f"state{i}", src, dst, paced=True) for i, (src, dst) in enumerate(zip(sources, targets, strict=True))]
        loss = torch.ones((), device=device) * 3
        assert loss.item() == 3.0  # a device->host copy on the compute stream, after the write-backs were queued
        assert not handles[-1].done(), "the small copy waited for the whole paced write-back"
        for i, handle in enumerate(handles):
            handle.wait()
            assert float(targets[i][0]) == float(i) and float(targets[i][-1]) == float(i)
    finally:
        engine.close()
        arena.close()


def test_a_failed_pacer_fails_its_queued_copies_and_issues_later_ones_at_once() -> None:
    """The thread cannot issue on its device (here: a CUDA device this machine lacks): every queued copy fails
    with that error instead of leaving its waiters hanging, and later copies are issued by the caller."""
    if torch.cuda.device_count() > 99:
        pytest.skip("a machine with a 100th CUDA device")
    pacer = _Pacer(torch.device("cuda", 99), in_flight_nbytes=1)
    queued = [Handle("d2h", f"k{i}", "gpu", "host", 8, None) for i in range(3)]
    with pacer._cond:  # held: the thread cannot record its failure before all three are queued
        for handle in queued:
            pacer.submit(handle, lambda handle=handle: handle._set_issued())  # type: ignore[misc]
    for handle in queued:
        handle._wait_complete()  # never hangs: the failure reaches every queued copy
        assert handle.error is not None
        with pytest.raises(type(handle.error)) as raised:  # what the device raises (RuntimeError, or a CPU build's)
            handle.wait()
        assert raised.value is handle.error
    late = Handle("d2h", "late", "gpu", "host", 8, None)
    pacer.submit(late, lambda: late._set_issued())
    assert late._issued.is_set() and late.error is None
    pacer.close()


def test_a_copy_taken_for_issue_is_failed_not_lost_when_the_pacer_breaks_waiting_for_room() -> None:
    class BrokenEvent:
        def query(self) -> bool:
            raise RuntimeError("a CUDA error of another kernel")

    pacer = _Pacer(torch.device("cpu"), in_flight_nbytes=8)
    first = Handle("d2h", "first", "gpu", "host", 8, None)
    second = Handle("d2h", "second", "gpu", "host", 8, None)
    with pacer._cond:
        pacer.submit(first, lambda: first._set_issued(end_event=BrokenEvent()))  # type: ignore[arg-type]
        pacer.submit(second, lambda: second._set_issued())
    with pytest.raises(RuntimeError, match="another kernel"):
        second.wait()  # it was off the queue, waiting for room behind 'first': failed with the error, no hang
    pacer.close()


def test_an_idle_pacer_holds_no_copy_s_tensors() -> None:
    import gc
    import weakref

    pacer = _Pacer(torch.device("cpu"), in_flight_nbytes=1 << 20)
    source = torch.ones(16)
    alive = weakref.ref(source)
    handle = Handle("d2h", "k", "gpu", "host", 64, None)
    done = threading.Event()
    event = _FakeCopyEvent()
    event.released.set()

    def issue(src: torch.Tensor = source) -> None:
        handle._set_issued(end_event=event)  # type: ignore[arg-type]
        done.set()

    pacer.submit(handle, issue)
    del source, issue
    assert done.wait(10)
    for _ in range(100):  # the thread drops its reference right after issuing
        gc.collect()
        if alive() is None:
            break
        threading.Event().wait(0.01)
    assert alive() is None
    pacer.close()


def test_a_pacer_without_a_thread_issues_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    pacer = _Pacer(torch.device("cpu"), in_flight_nbytes=8)
    handle = Handle("d2h", "k", "gpu", "host", 8, None)
    pacer.submit(handle, lambda: handle._set_issued())
    assert handle._issued.is_set()
    pacer.close()  # nothing to join


def test_paced_copies_without_cuda_are_plain_synchronous_copies() -> None:
    engine = TransferEngine(torch.device("cpu"))
    try:
        src, dst = torch.arange(10.0), torch.zeros(10)
        handle = engine.d2h("k", src, dst, paced=True)
        assert handle.done() and torch.equal(dst, src)
        assert engine._pacer._thread is None  # nothing to pace: no thread was started
    finally:
        engine.close()


@pytest.fixture
def gated_write(device: torch.device, nvme_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """An engine with one file write in flight that lasts until the test opens ``gate``."""
    gate, writing, real_write = threading.Event(), threading.Event(), NVMeDirectory.write

    def held_write(self, *args, **kwargs):
        writing.set()
        gate.wait(10)  # the write under test is still reading its source until the test lets it go
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(NVMeDirectory, "write", held_write)
    eng = TransferEngine(device, io_threads=1)
    directory = NVMeDirectory(nvme_dir, 1 << 20)
    swap = directory.create(TensorKey("w"), TensorMeta(torch.uint8, 4096))
    write = eng.write("w", directory, swap, torch.zeros(4096, dtype=torch.uint8))
    assert writing.wait(10)
    try:
        yield eng, gate, write
    finally:
        gate.set()
        eng.close()
        directory.close()


def test_a_second_close_waits_for_the_io_the_first_one_waits_for(gated_write) -> None:
    """Two threads closing one engine (an exit hook beside a signal's cleanup): the second returned at once while
    the first still waited for the IO, and its store then freed the arena the IO was writing from."""
    eng, gate, write = gated_write
    first = threading.Thread(target=eng.close)
    first.start()
    while not eng._closed:  # the first close has begun (it waits on the write from here on)
        time.sleep(0.001)
    second_returned = threading.Event()
    second = threading.Thread(target=lambda: (eng.close(), second_returned.set()))
    second.start()
    assert not second_returned.wait(0.3), "the second close() returned while the write was still running"
    gate.set()
    second.join(10)
    first.join(10)
    assert second_returned.is_set() and write.done()


def test_an_interrupt_during_close_waits_for_the_io_before_it_is_raised(gated_write) -> None:
    """SIGTERM's exception (here a KeyboardInterrupt from a timer signal) arriving while close() waits for the IO:
    close() raised at once, and the store freed the arena under the IO thread (a segfault in bench store)."""
    eng, gate, write = gated_write

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    opener = threading.Timer(0.5, gate.set)  # the write ends well after the interrupt
    opener.start()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            eng.close()
        assert write.done(), "close() raised the interrupt while the write was still running"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        opener.cancel()


def test_a_close_on_one_of_the_engine_s_threads_is_refused_and_the_engine_still_closes(gated_write) -> None:
    """A close on one of the engine's own threads (a completion callback closing the store) would wait for itself:
    refused there, and the engine is closed as usual from another thread after."""
    eng, gate, write = gated_write
    errors: list[BaseException] = []

    def close_here() -> None:
        try:
            eng.close()
        except RuntimeError as error:
            errors.append(error)

    own = threading.Thread(target=close_here, name="tierstore-done_0")  # named as the engine's completion threads
    own.start()
    own.join(10)
    assert not own.is_alive() and len(errors) == 1 and "own IO threads" in str(errors[0])
    gate.set()
    write.wait()
    eng.close()  # not hung, and the pools are shut
    assert eng._io_pool._shutdown and eng._done_pool._shutdown
