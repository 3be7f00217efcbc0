"""What this machine's paths and optimizer run at: the one copy probe, the one CPU AdamW timing, and the ``Rates``
auto placement plans with (``measure_rates``, once per process).

``auto`` placement (``runtime.planning.auto_placement``, which receives the ``Rates`` and times nothing), the
profiler's ceilings (``runtime.profiler.ceilings``) and the training benchmark's bound (``runtime.bench.train_bound``)
all measure the same two things; they differ only in sizes, repeats and which statistic they keep. Auto placement
also times the AdamW kernel while copies run each way (what the CPU's updates get in a step); the bound keeps the
kernel alone (a lower bound on the step). Here beside the kernel it times, above the planning that reads the
figures. Pure measurement: nothing here decides anything.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from runtime.config.units import format_size
from runtime.planning.auto_placement import Rates
from runtime.update.adam import AdamWHyper
from runtime.update.moment_kernel import Int8Kernel
from runtime.update.moments import MomentScratch, adamw_update_block, encode_moment, moment_storage
from tierstore import HostMemoryError, PinnedArena

log = logging.getLogger(__name__)

PCIE_MIN_NBYTES = 32 << 20  # the copy probe halves its buffer down to this when the GPU has no room for it
ADAM_PROBE_NUMEL = 32 << 20  # parameters timed for the CPU AdamW rate (512 MiB of master, grad, moments)
ADAM_PROBE_TENSORS = 16  # the probe's parameters, as views: the fused kernel sees a list, as in a block
# Timed steps of each AdamW probe, the median kept. One step is ~7 ms on the H100 box, and beside copies the
# rate varied by a fifth between two processes of one machine with three (call J3: 2.75 and 3.34 G params/s).
ADAM_PROBE_REPEATS = 7
COPY_PROBE_NBYTES = 256 << 20  # bytes timed for each copy direction


def best_s(repeats: int, run: Callable[[], float], warmups: int = 1) -> float:
    """The fastest of ``repeats`` timed runs after ``warmups`` untimed ones (first touch of the pages, the
    CUDA context, the file's blocks, clocks leaving idle): a ceiling is what the path can reach."""
    for _ in range(warmups):
        run()
    return min(run() for _ in range(repeats))


def pinned_copy_gbps(device: torch.device, nbytes: int, repeats: int, *, warmups: int = 1,
                     pin: bool | None = None) -> tuple[float, float]:
    """(H2D, D2H) GB/s of one plain copy of ``nbytes`` between host memory (pinned unless ``pin`` is False;
    default: pinned on CUDA) and ``device``, each the best of ``repeats`` after ``warmups``; on a GPU timed by
    CUDA events on a side stream (no launch or sync overhead in the figure), on the CPU by the host clock."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    with _probe_buffers(device, nbytes, cuda if pin is None else pin) as (host, target):

        def copy_s(to_device: bool) -> float:
            dst, src = (target, host) if to_device else (host, target)
            if stream is None:
                start = time.perf_counter()
                dst.copy_(src)
                return time.perf_counter() - start
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                begin.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
            end.synchronize()
            return begin.elapsed_time(end) / 1000.0

        h2d_s = best_s(repeats, lambda: copy_s(True), warmups=warmups)
        d2h_s = best_s(repeats, lambda: copy_s(False), warmups=warmups)
        return host.numel() / h2d_s / 1e9, host.numel() / d2h_s / 1e9


@contextmanager
def _probe_buffers(device: torch.device, nbytes: int, pin: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A device buffer and a host buffer of nbytes, halved (down to PCIE_MIN_NBYTES) while the device has no
    room: the profiler probes beside a session that may fill the GPU. The host side is an exact-size arena,
    pinned as the host tier pins it and unpinned afterwards, not torch's caching host allocator, which would
    round the request up and keep it pinned for the life of the process."""
    while True:
        try:
            target = torch.empty(nbytes, dtype=torch.uint8, device=device)  # first: the device is what may be full
            break
        except torch.OutOfMemoryError:
            if nbytes // 2 < PCIE_MIN_NBYTES:
                raise
            log.info("copy probe: no room for %s on %s, trying half", format_size(nbytes), device)
            nbytes //= 2
    arena = PinnedArena(nbytes, pin=pin, name="copy probe")
    try:
        yield arena.view(0, nbytes), target
    finally:
        del target
        arena.close()


def cpu_adam_seconds_beside_copies(device: torch.device, numel: int, threads: int, *, tensors: int = 1,
                                   repeats: int = 3, copy_nbytes: int, pin: bool = True, moment_dtype: str = "fp32",
                                   int8_kernel: Int8Kernel | None = None) -> tuple[list[float], bool]:
    """``cpu_adam_seconds`` while copies of ``copy_nbytes`` run back to back each way between host memory and the
    CUDA ``device``, as they do beside the CPU's updates in an offloaded step (gradients and streamed state
    leaving, weights and streamed state arriving): the DMA shares host memory's bandwidth with the kernel. On
    the H100 box the kernel ran at 2.9-3.3 G params/s inside a step against 4.5-4.7 timed alone (call H5 in
    docs/measurements-history.md). A thread keeps two copies queued each way until the kernel's last step ends,
    waiting on blocking events (a spinning wait would take a core from the kernel's threads). Returns the times
    and whether copies completed between the first timed step's start and the last one's end with the thread
    still feeding (False: some steps may have run alone, and the figure is an upper bound)."""
    if device.index is None:  # 'cuda': the feeding thread must be told which device, and starts on device 0
        device = torch.device("cuda", torch.cuda.current_device())
    stop, started = threading.Event(), threading.Event()
    copied = [0]
    errors: list[BaseException] = []
    with _probe_buffers(device, copy_nbytes, pin) as (host_in, device_in), \
            _probe_buffers(device, copy_nbytes, pin) as (host_out, device_out):
        streams = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def feed() -> None:
            queued: list[torch.cuda.Event] = []
            try:
                torch.cuda.set_device(device)  # a new thread starts on device 0
                while not stop.is_set():
                    for stream, dst, src in ((streams[0], device_in, host_in), (streams[1], host_out, device_out)):
                        with torch.cuda.stream(stream):
                            dst.copy_(src, non_blocking=True)
                            queued.append(torch.cuda.Event(blocking=True))
                            queued[-1].record(stream)
                    if len(queued) > 4:  # two copies each way ahead of the one running
                        queued.pop(0).synchronize()
                        queued.pop(0).synchronize()
                        copied[0] += 1
                        started.set()
            except BaseException as error:  # re-raised by the caller
                errors.append(error)
            finally:
                started.set()
                for stream in streams:  # nothing may still read or write the buffers when they are freed
                    try:
                        stream.synchronize()
                    except BaseException as error:
                        errors.append(error)

        marks: list[tuple[int, bool]] = []  # (copies completed, feeder alive) at the first timed step and after the last
        feeder = threading.Thread(target=feed, name="copy probe", daemon=True)
        feeder.start()
        try:
            started.wait()
            if errors:
                raise errors[0]
            times = cpu_adam_seconds(numel, threads, tensors=tensors, repeats=repeats,
                                     mark=lambda: marks.append((copied[0], feeder.is_alive() and not errors)),
                                     moment_dtype=moment_dtype, int8_kernel=int8_kernel)
        finally:
            stop.set()
            feeder.join()
        if errors:
            raise errors[0]
        (first, _), (last, alive) = marks
        return times, alive and last > first


def cpu_adam_seconds(numel: int, threads: int, *, tensors: int = 1, repeats: int = 3,
                     mark: Callable[[], None] | None = None, moment_dtype: str = "fp32",
                     int8_kernel: Int8Kernel | None = None) -> list[float]:
    """Seconds of each of ``repeats`` CPU AdamW steps (the runtime's own block update, ``adamw_update_block``) over
    ``numel`` fp32 parameters split into ``tensors`` parameters, their moments stored as ``moment_dtype`` (with
    ``int8_kernel``: int8 through the compiled kernel, as the run's updates), with ``threads`` threads, after one
    untimed step that faults the pages in. The caller keeps the statistic it needs (a ceiling the best, a typical
    step the median). ``mark``: called just before the first timed step and just after the last."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        size = max(1, numel // tensors)
        sizes = [size] * tensors
        master, grad = torch.full((size * tensors,), 1e-3), torch.full((size * tensors,), 1e-3)
        stored_dtype, stored_numel = moment_storage(moment_dtype, sizes)
        exp_avg, exp_avg_sq = (torch.zeros(stored_numel, dtype=stored_dtype) for _ in range(2))
        for kind, stored in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            encode_moment(torch.full((size * tensors,), 1e-3), moment_dtype, kind, sizes, stored)
        steps = [torch.zeros(()) for _ in range(tensors)]
        hypers, keep = [AdamWHyper()] * tensors, [True] * tensors
        scratch = MomentScratch(int8_kernel=int8_kernel)  # one per updating thread, as the worker keeps
        times = []
        for attempt in range(repeats + 1):
            if attempt == 1 and mark is not None:
                mark()
            start = time.perf_counter()
            adamw_update_block(master, grad, exp_avg, exp_avg_sq, sizes, keep, steps, hypers, moment_dtype,
                               scratch=scratch)
            if attempt:
                times.append(time.perf_counter() - start)
        if mark is not None:
            mark()
        return times
    finally:
        torch.set_num_threads(previous)


def measure_rates(device: torch.device, *, cpu_threads: int, pin: bool = True, moment_dtype: str = "fp32",
                  int8_kernel: Int8Kernel | None = None) -> Rates:
    """Time the CPU AdamW update (``cpu_threads`` threads, moments stored as ``moment_dtype``, int8 through
    ``int8_kernel`` where given: the update the run's CPU will run, whose speed differs by format, bf16 0.9x and
    int8 in torch ops 0.3x fp32's on 2 cores) and copies each way between host memory (pinned when ``pin``)
    and ``device``, once per process for the same arguments, then AdamW again while copies run each way. Before
    the beside-copies probe and the 7-step medians it took about half a second (H100 box, 14 threads: 0.32 s for
    AdamW at 4.7 G params/s, 0.24 s for the copies at 55 GB/s each way, CUDA start included); each probe now adds
    a few tens of milliseconds of timed steps (not re-timed on a GPU)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _measured(index, cpu_threads, pin, moment_dtype, int8_kernel)


# Cached for the process (the one piece of module state here): the rates are the machine's, and a second
# offload in the same process should neither pay for them again nor choose differently by timing noise.
@functools.cache
def _measured(device_index: int, cpu_threads: int, pin: bool, moment_dtype: str,
              int8_kernel: Int8Kernel | None) -> Rates:
    started = time.perf_counter()
    device = torch.device("cuda", device_index)
    alone_s = cpu_adam_seconds(ADAM_PROBE_NUMEL, cpu_threads, tensors=ADAM_PROBE_TENSORS, repeats=ADAM_PROBE_REPEATS,
                               moment_dtype=moment_dtype, int8_kernel=int8_kernel)
    alone = ADAM_PROBE_NUMEL / statistics.median(alone_s)
    beside = _adam_rate_beside_copies(device, cpu_threads, pin, alone=alone, moment_dtype=moment_dtype,
                                      int8_kernel=int8_kernel)
    rates = Rates(adam_params_per_s=beside,
                  adam_alone_params_per_s=alone, **_copy_rates(device, pin))
    log.info("measured for auto placement in %.2f s (CPU AdamW with %s moments%s): %s", time.perf_counter() - started,
             moment_dtype, ", the compiled kernel" if int8_kernel is not None and moment_dtype == "int8" else "",
             rates.describe())
    return rates


def _adam_rate_beside_copies(device: torch.device, threads: int, pin: bool, *, alone: float, moment_dtype: str = "fp32",
                             int8_kernel: Int8Kernel | None = None) -> float:
    """Parameters a second of the CPU AdamW update (the run's moment format) while copies run each way, the median of
    ``ADAM_PROBE_REPEATS`` steps after a warm-up (the alone rate beside it is a median too): what the CPU's
    updates get in a step, where the copies to and from the GPU share host memory's bandwidth with them (on the
    H100 box the kernel alone was 1.4-1.8x faster; planned with the alone rate, auto placement streamed less
    than the best hand-set rows, calls H5, H8 and J1 in docs/measurements-history.md). At most
    ``alone``, the kernel's rate with no copies (a faster figure is timing noise); ``alone`` itself where the
    probe cannot run (no room for its buffers, pinning refused: the larger probe may not fit where the copy
    probe after it does). Any other error (a dead CUDA context, a bug) surfaces."""
    try:
        times, beside = cpu_adam_seconds_beside_copies(device, ADAM_PROBE_NUMEL, threads, tensors=ADAM_PROBE_TENSORS,
                                                       repeats=ADAM_PROBE_REPEATS, copy_nbytes=COPY_PROBE_NBYTES, pin=pin,
                                                       moment_dtype=moment_dtype, int8_kernel=int8_kernel)
    except (torch.OutOfMemoryError, HostMemoryError) as error:  # no room on the device, pinning refused
        log.warning("auto placement could not time CPU AdamW beside copies (%s); it plans with the rate timed "
                    "alone, %.2f G params/s, which overstates the CPU's speed in a step", error, alone / 1e9)
        return alone
    if not beside:
        log.debug("CPU AdamW probe: no copy completed while the kernel ran; its rate beside copies is overstated")
    return min(alone, ADAM_PROBE_NUMEL / statistics.median(times))


def _copy_rates(device: torch.device, pin: bool) -> dict[str, float]:
    """Bytes a second each way, best of three, over one buffer in host memory pinned as the host tier pins it."""
    h2d, d2h = pinned_copy_gbps(device, COPY_PROBE_NBYTES, 3, warmups=0, pin=pin)
    # The probe's device buffer must not stay in the allocator's cache: `tiers.gpu.budget: auto` is a share of
    # the memory free after this.
    torch.cuda.empty_cache()
    return {"h2d_bytes_per_s": h2d * 1e9, "d2h_bytes_per_s": d2h * 1e9}
