"""The transfer engine: the only code that moves bytes between tiers.

Host<->GPU copies run on two dedicated CUDA streams (one per direction, so both directions overlap) and
are guarded by CUDA events; file IO runs on a thread pool whose size is the queue depth. Every transfer
returns a :class:`Handle`; a completed transfer is published once on the event bus. Background write-backs
(``d2h(..., paced=True)``) are handed to the copy stream a piece at a time by :class:`_Pacer` (see there why).
Without CUDA, host<->"GPU" copies are plain synchronous ``copy_`` and their handles are born done.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tierstore.events import EventBus, TransferEvent
from tierstore.lifecycle import close_at_exit
from tierstore.nvme import NVMeDirectory, SwapFile

log = logging.getLogger(__name__)


class Handle:
    """A transfer in flight. ``wait()`` blocks until it is complete (raising its error, if any);
    ``done()`` asks without blocking; ``wait_stream()`` makes a CUDA stream wait without blocking the host."""

    def __init__(self, kind: str, key: str, src_tier: str, dst_tier: str, nbytes: int, bus: EventBus | None):
        self.kind = kind
        self.key = key
        self.src_tier = src_tier
        self.dst_tier = dst_tier
        self.nbytes = nbytes
        self.start_s = time.perf_counter()
        self._bus = bus
        self._lock = threading.Lock()
        self._issued = threading.Event()  # set once the work is enqueued (CUDA) or finished (IO)
        self._completed = threading.Event()  # set once the event is published and every callback has run
        self._future: Future[None] | None = None
        self._start_event: torch.cuda.Event | None = None
        self._end_event: torch.cuda.Event | None = None
        self._error: BaseException | None = None
        self._finished = False
        self._callbacks: list[Callable[[Handle], None]] = []
        # File IO completes on another thread than the one that moved the bytes (TransferEngine._complete_io):
        # its event reports when and where the move ended, not when the callbacks got a thread.
        self._moved_end_s: float | None = None
        self._moved_by: str | None = None

    # ---- completion --------------------------------------------------------------------------------
    def done(self) -> bool:
        """True once the transfer has completed (successfully or not) and its completion callbacks have run."""
        if self._completed.is_set():
            return True
        if not self._issued.is_set():
            return False
        if self._error is None and self._end_event is not None and not self._end_event.query():
            return False
        self._finish()
        return self._completed.is_set()  # False while another thread is still running the callbacks

    def wait(self) -> Handle:
        """Block the calling thread until the transfer is complete and its completion callbacks (state
        changes of the store, event listeners) have run; re-raises a transfer error."""
        self._wait_complete()
        if self._error is not None:
            raise self._error
        return self

    def _wait_complete(self, callbacks: bool = True) -> None:
        """Block until the bytes have moved and, with ``callbacks``, until the callbacks have run; never raises.
        ``callbacks=False`` is for code holding a lock that a callback may need (it then settles itself)."""
        if self._completed.is_set():
            return
        self._issued.wait()
        if self._error is None and self._end_event is not None:
            self._end_event.synchronize()
        self._finish()
        if callbacks:
            self._completed.wait()

    def wait_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream`` (default: the current stream) after this transfer without blocking the host
        once the copy is enqueued. Host-side transfers (file IO, CPU copies) are waited for on the host."""
        self._issued.wait()
        if self._error is not None:
            raise self._error
        if self._end_event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self._end_event)
        else:
            self.wait()

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        """Run callback(handle) once, at the first observation of completion (immediately if complete)."""
        with self._lock:
            if not self._completed.is_set():
                self._callbacks.append(callback)  # run, in order, by the thread finishing the transfer
                return
        callback(self)

    @property
    def error(self) -> BaseException | None:
        """The exception the transfer failed with, if any (only meaningful once done)."""
        return self._error

    # ---- engine side -------------------------------------------------------------------------------
    def _set_issued(self, end_event: torch.cuda.Event | None = None, start_event: torch.cuda.Event | None = None) -> None:
        self._start_event, self._end_event = start_event, end_event
        self._issued.set()

    def _fail(self, error: BaseException) -> None:
        self._set_failed(error)
        self._finish()

    def _set_failed(self, error: BaseException) -> None:
        self._error = error
        self._issued.set()

    def _finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
        end_s = self._moved_end_s or time.perf_counter()
        try:
            if self._error is None and self._bus is not None:
                device_s = None
                if self._start_event is not None and self._end_event is not None:
                    device_s = self._start_event.elapsed_time(self._end_event) / 1000.0
                self._bus.publish(
                    TransferEvent(self.kind, self.key, self.src_tier, self.dst_tier, self.nbytes, self.start_s, end_s, device_s,
                                  self._moved_by or threading.current_thread().name)
                )
        finally:
            while True:  # callbacks added while these run are run here too, so none is lost or reordered
                with self._lock:
                    callbacks, self._callbacks = self._callbacks, []
                    if not callbacks:
                        self._completed.set()
                        break
                for callback in callbacks:
                    try:
                        callback(self)
                    except Exception:
                        log.exception("transfer completion callback failed for %s", self.key)

    def __repr__(self) -> str:
        state = "done" if self._finished else ("issued" if self._issued.is_set() else "pending")
        return f"Handle({self.kind} {self.key} {self.nbytes:,} B {self.src_tier}->{self.dst_tier}, {state})"


def done_handle(key: str, tier: str) -> Handle:
    """A handle for work that needed no transfer (the copy was already where it was asked for)."""
    handle = Handle("none", key, tier, tier, 0, None)
    handle._set_issued()
    handle._finish()
    return handle


class TransferEngine:
    """Issues every copy: H2D / D2H on dedicated streams, file reads / writes on ``io_threads`` workers."""

    def __init__(self, device: torch.device, io_threads: int = 4, bus: EventBus | None = None):
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.device = device
        self.bus = bus or EventBus()
        self.cuda = device.type == "cuda"
        self.h2d_stream = torch.cuda.Stream(device) if self.cuda else None
        self.d2h_stream = torch.cuda.Stream(device) if self.cuda else None
        self._io_pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="tierstore-io")
        # Completion callbacks of file IO run on threads of their own (see _complete_io).
        self._done_pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="tierstore-done")
        # Device copies whose completion nobody has observed yet: poll() publishes them, so copies that
        # are only ever waited for on a stream (wait_stream) still reach the event bus.
        self._unobserved: collections.deque[Handle] = collections.deque()
        self._unobserved_lock = threading.Lock()
        self._closed = False
        self._close_lock = threading.Lock()
        self._close_done = threading.Event()  # set when the first close() has stopped every IO and copy
        # Work queued or running on the two pools: close() waits for it on this condition, not by joining the
        # pools' threads (a join cut by an interrupt marks its thread stopped in Python 3.11, so a second join
        # returns at once while the thread still runs).
        self._busy = 0
        self._idle = threading.Condition()
        self._pacer = _Pacer(device, PACED_IN_FLIGHT_NBYTES)
        close_at_exit(self, TransferEngine.close)  # queued writes land and the pool stops before Python's own exit

    # ---- host <-> device ----------------------------------------------------------------------------
    def h2d(self, key: str, src: torch.Tensor, dst: torch.Tensor, after: Handle | None = None,
            order_after_current: bool = True, dst_waited: bool = False) -> Handle:
        """Copy host src into device dst. ``after``: a transfer that must complete first (e.g. staging).
        ``order_after_current``: wait for the work queued on the caller's stream first (needed when dst was
        just allocated there); pass False for a dst used only on the copy stream. ``dst_waited``: every stream that
        uses or frees dst waits for the handle first (a stream other than dst's own records its use before the
        free), so the copy stream's use of dst needs no record (a recorded use holds dst's memory from the
        allocator until an event says the copy ended)."""
        return self._device_copy("h2d", key, "host", "gpu", src, dst, self.h2d_stream, after, order_after_current,
                                 dst_waited=dst_waited)

    def d2h(self, key: str, src: torch.Tensor, dst: torch.Tensor, after: Handle | None = None,
            paced: bool = False) -> Handle:
        """Copy device src into host dst. The copy is ordered after the work queued so far on the current
        stream (which produced src); src's memory is kept alive until the copy ends. ``paced``: a write-back
        nobody waits for soon, given to the copy engine a piece at a time (see :class:`_Pacer`)."""
        return self._device_copy("d2h", key, "gpu", "host", src, dst, self.d2h_stream, after, paced=paced)

    def h2d_then(self, key: str, src: torch.Tensor, dst: torch.Tensor, then: Callable[[torch.cuda.Stream | None], None],
                 after: Handle | None = None, order_after_current: bool = True) -> Handle:
        """h2d, then ``then(stream)`` enqueued on the copy stream before the handle's event (e.g. a dtype
        cast of the staged bytes), so that waiting on the handle also waits for it. What ``then`` writes gets no
        recorded use: as with ``dst_waited``, the caller waits for the handle before that memory is used or freed."""
        return self._device_copy("h2d", key, "host", "gpu", src, dst, self.h2d_stream, after, order_after_current, then)

    def _device_copy(self, kind: str, key: str, src_tier: str, dst_tier: str, src: torch.Tensor, dst: torch.Tensor,
                     stream: torch.cuda.Stream | None, after: Handle | None, order_after_current: bool = True,
                     then: Callable[[torch.cuda.Stream | None], None] | None = None, paced: bool = False,
                     dst_waited: bool = False) -> Handle:
        if src.numel() != dst.numel() or src.dtype != dst.dtype:
            raise ValueError(f"copy of {key}: src {src.dtype} x{src.numel()} does not match dst {dst.dtype} x{dst.numel()}")
        handle = Handle(kind, key, src_tier, dst_tier, src.numel() * src.element_size(), self.bus)
        producer = None
        if stream is not None and order_after_current:
            # Order after whatever the caller's stream queued so far: it produced src, or it last used the
            # memory now handed to dst by the caching allocator.
            producer = torch.cuda.current_stream(self.device).record_event()

        def issue() -> None:
            try:
                if stream is None:
                    dst.copy_(src)
                    if then is not None:
                        then(None)
                    handle._set_issued()
                    handle._finish()
                    return
                with torch.cuda.stream(stream):
                    if producer is not None:
                        stream.wait_event(producer)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    dst.copy_(src, non_blocking=True)
                    if then is not None:
                        then(stream)
                    end.record(stream)
                    # Neither buffer may be reused by the allocator before the side stream is done with it (a dst
                    # whose users all wait for the handle first excepted: dst_waited).
                    for tensor in (src, dst) if not dst_waited else (src,):
                        if tensor.is_cuda:
                            tensor.record_stream(stream)
                handle._set_issued(end, start)
                with self._unobserved_lock:
                    self._unobserved.append(handle)
            except BaseException as exc:  # surfaces through wait()
                handle._fail(exc)

        if paced and stream is not None and after is None:
            self._pacer.submit(handle, issue)
        elif after is None or after.done() and after.error is None:
            issue()
        else:
            def on_after(prev: Handle) -> None:
                if prev.error is not None:
                    handle._fail(prev.error)
                else:
                    issue()
            after.add_done_callback(on_after)
        return handle

    # ---- host <-> file ------------------------------------------------------------------------------
    def read(self, key: str, directory: NVMeDirectory, swap: SwapFile, dst: torch.Tensor,
             expected_step: int | None = None) -> Handle:
        """Read key's swap file into host dst (a uint8 buffer) on an IO worker; checksum verified, and the
        header's step against ``expected_step`` when given."""
        handle = Handle("read", key, "nvme", "host", swap.meta.nbytes, self.bus)
        self._submit_io(handle, lambda: directory.read(swap, dst, expected_step))
        return handle

    def write(self, key: str, directory: NVMeDirectory, swap: SwapFile, src: torch.Tensor, step: int = 0,
              after: Handle | None = None, fsync: bool = False) -> Handle:
        """Write host src (a uint8 buffer) to key's swap file on an IO worker, after ``after`` completes."""
        handle = Handle("write", key, "host", "nvme", swap.meta.nbytes, self.bus)
        job = lambda: directory.write(swap, src, step=step, fsync=fsync)  # noqa: E731
        if after is None:
            self._submit_io(handle, job)
        else:
            after.add_done_callback(lambda prev: handle._fail(prev.error) if prev.error else self._submit_io(handle, job))
        return handle

    def _submit_io(self, handle: Handle, job: Callable[[], int]) -> None:
        if self._closed:
            handle._fail(_closed_error(handle))
            return

        def run() -> None:
            handle.start_s = time.perf_counter()  # time the IO itself, not the queueing
            try:
                moved = job()
                if moved != handle.nbytes:
                    raise RuntimeError(f"{handle.kind} of {handle.key} moved {moved} bytes, expected {handle.nbytes}")
            except BaseException as exc:
                handle._set_failed(exc)
            else:
                handle._moved_end_s, handle._moved_by = time.perf_counter(), threading.current_thread().name
                handle._set_issued()
            self._complete_io(handle)

        try:
            handle._future = self._submit(self._io_pool, run)
        except RuntimeError:  # close(), or the interpreter's exit, shut the pool after the check above
            handle._fail(_closed_error(handle))

    def _submit(self, pool: ThreadPoolExecutor, work: Callable[[], None]) -> Future[None]:
        """Queue ``work`` on ``pool``, counted until it has run (close() waits for the count to reach zero)."""
        with self._idle:
            self._busy += 1

        def counted() -> None:
            try:
                work()
            finally:
                self._one_done()

        try:
            return pool.submit(counted)
        except BaseException:
            self._one_done()
            raise

    def _one_done(self) -> None:
        with self._idle:
            self._busy -= 1
            if not self._busy:
                self._idle.notify_all()

    def _wait_idle(self) -> None:
        """Until no work is queued or running on the pools (an IO's completion is queued before the IO counts
        as done, so the count never touches zero between the two)."""
        with self._idle:
            while self._busy:
                self._idle.wait()

    def _complete_io(self, handle: Handle) -> None:
        """Run a finished file transfer's completion callbacks off the IO thread that moved its bytes.

        Why: the store's callbacks take its lock, and a fetch holding that lock may be waiting for a read still
        queued on these threads. Callbacks run on the IO threads would wait for the lock while the lock's holder
        waits for a free IO thread: a deadlock once every IO thread finishes a transfer in that window. Here the IO
        threads only move bytes; a waiter holding the lock (``_wait_complete(callbacks=False)``) runs the callbacks
        itself when it gets there first."""
        try:
            self._submit(self._done_pool, handle._finish)
        except RuntimeError:
            # The interpreter's exit shut the pool, or no thread could start (a pids limit): complete here, as before
            # the done pool, when the rare wait above is possible again. (A submit whose thread failed to start may
            # have queued the call too: _finish runs its callbacks once whoever calls it first.)
            handle._finish()

    def poll(self) -> None:
        """Publish every device copy that has completed (non-blocking; copies complete in stream order)."""
        while True:
            with self._unobserved_lock:
                if not self._unobserved:
                    return
                handle = self._unobserved[0]
            # done() may run completion callbacks that take other locks: never call it holding ours.
            # Copies on the two streams interleave; one not done yet may hide later done ones, which the
            # next poll publishes.
            if not handle.done():
                return
            with self._unobserved_lock:
                if self._unobserved and self._unobserved[0] is handle:
                    self._unobserved.popleft()

    def synchronize(self) -> None:
        """Wait for every device copy on the copy streams (not file IO, not paced copies the pacer has yet to
        issue) and publish them."""
        for stream in (self.h2d_stream, self.d2h_stream):
            if stream is not None:
                stream.synchronize()
        self.poll()

    def close(self) -> None:
        """Finish queued IO and stop the workers; on return (or raise) no IO or copy touches host memory any more.

        Why it waits even when interrupted: the store frees the pinned arena and the swap files as soon as this
        returns or raises, and an IO thread still writing from the arena then reads unmapped memory (a segfault:
        SIGTERM's exception arriving while the main thread waited here). So an interrupt during the wait is held
        until the IO is done, then raised; and a second caller (another thread: an exit hook, a signal's cleanup)
        waits for the first one's close instead of returning at once into the same free."""
        # The engine's own threads are what a close waits for: on one of them, waiting would never end.
        if threading.current_thread().name.startswith(("tierstore-io", "tierstore-done")):
            if self._closed:
                return
            raise RuntimeError("the transfer engine was closed from one of its own IO threads (a completion callback "
                               "closing the store): close it from another thread")
        with self._close_lock:
            first = not self._closed
            self._closed = True
        if not first:
            _wait_uninterrupted(self._close_done.wait)
            return
        try:
            _wait_uninterrupted(self._pacer.close)  # every paced copy is issued before the streams are synchronized
            _wait_uninterrupted(self._wait_idle)  # every IO and every completion queued behind it has run
            _wait_uninterrupted(lambda: self._io_pool.shutdown(wait=True))
            _wait_uninterrupted(lambda: self._done_pool.shutdown(wait=True))
            _wait_uninterrupted(self.synchronize)  # device copies from pinned memory have ended
        finally:
            self._close_done.set()


def _wait_uninterrupted(wait: Callable[[], object]) -> None:
    """Run ``wait`` to its end: an interrupt raised into this thread meanwhile (KeyboardInterrupt, SystemExit,
    runtime's SIGTERM exception: the BaseExceptions that are no Exception) is held, the wait taken up again, and
    the first interrupt raised once it returned. An error of the wait itself propagates at once."""
    interrupt: BaseException | None = None
    while True:
        try:
            wait()
            break
        except Exception:
            raise
        except BaseException as error:  # held and re-raised below: the wait must end first
            if interrupt is None:
                interrupt = error
    if interrupt is not None:
        raise interrupt


PACED_IN_FLIGHT_NBYTES = 64 << 20  # paced copies on the copy stream at once (at least one, whatever its size)
POLL_S = 0.0002  # the pacer's sleep between looks at a copy in flight (a spinning wait would take a core)


def _sleep_until_done(handle: Handle) -> None:
    """Wait for a device copy's end event without spinning a core (CUDA's default event wait spins)."""
    event = handle._end_event
    if event is None or handle.error is not None:
        return
    while not event.query():
        time.sleep(POLL_S)


class _Pacer:
    """Hands background device->host copies to the copy stream a few at a time, in submission order.

    Why: a GPU's copy engine serves the device->host copies of every stream in the order they were queued. The
    state written back after the optimizer step (several GB of streamed master and moments) queued at once
    would make any later device->host copy wait for all of it: the user's ``loss.item()``, and with it the
    enqueueing of the next forward, behind ~0.1 s of write-back. Paced, such a copy waits for at most the
    piece in flight. The pacer only issues the copies and waits for their CUDA events; their completion is
    observed (callbacks run, device memory freed) by whoever polls the engine, as for any copy: running
    callbacks here could wait on the store's lock while its holder waits for a copy only this thread issues.
    """

    def __init__(self, device: torch.device, in_flight_nbytes: int):
        self.device = device
        self.in_flight_nbytes = in_flight_nbytes
        self._queue: collections.deque[tuple[Handle, Callable[[], None]]] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failed: BaseException | None = None
        self._index: int | None = None  # the CUDA device the thread issues on

    def submit(self, handle: Handle, issue: Callable[[], None]) -> None:
        """Queue ``issue`` (which enqueues handle's copy and marks it issued); after close(), issue at once."""
        if self._index is None and self.device.type == "cuda":
            self._index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        with self._cond:
            if self._thread is None and not self._closed and self._failed is None:
                thread = threading.Thread(target=self._run, name="tierstore-pacer", daemon=True)
                try:
                    thread.start()
                except RuntimeError as exc:  # no thread to be had (a pids limit): every copy is issued at once
                    log.warning("the write-back pacer could not start (%s); write-backs are issued unpaced", exc)
                    self._failed = exc
                else:
                    self._thread = thread
            if not self._closed and self._failed is None:
                self._queue.append((handle, issue))
                self._cond.notify()
                return
        issue()

    def _run(self) -> None:
        try:
            self._pace()
        except BaseException as exc:  # a waiter must not hang on a copy nobody will issue
            log.exception("the write-back pacer failed; queued copies fail with its error")
            with self._cond:
                self._failed, queued = exc, list(self._queue)
                self._queue.clear()
            for handle, _ in queued:
                handle._fail(exc)

    def _pace(self) -> None:
        if self._index is not None:
            torch.cuda.set_device(self._index)
        in_flight: collections.deque[Handle] = collections.deque()
        nbytes = 0
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                handle, issue = self._queue.popleft()
            try:
                while in_flight and nbytes + handle.nbytes > self.in_flight_nbytes:
                    oldest = in_flight.popleft()
                    nbytes -= oldest.nbytes
                    _sleep_until_done(oldest)  # may raise (a CUDA error of another kernel)
            except BaseException:
                with self._cond:
                    self._queue.appendleft((handle, issue))  # failed by _run with the rest, not lost
                raise
            issue()
            del issue  # the closure holds the copy's tensors: an idle pacer must not keep them allocated
            in_flight.append(handle)
            nbytes += handle.nbytes

    def close(self) -> None:
        """Let the thread issue every queued copy, then stop it."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


def _closed_error(handle: Handle) -> RuntimeError:
    """A transfer asked for after close(): a bug of the caller (or a thread still running at exit)."""
    return RuntimeError(f"{handle.kind} of {handle.key}: the transfer engine is closed (its store was closed, or the "
                        "interpreter is exiting); no transfer may start after close()")
