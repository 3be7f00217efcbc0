"""The profiler's listening side: subscribes to the store's transfer events and the controller's stall and step
events, and keeps what they say with O(1) work per event. Everything that costs more (interval unions,
per-step tables, advice) happens later, in ``analysis``, on a snapshot.

Per step the profiler remembers a *mark* at each commit (``optimizer.step()``): how many transfers and stalls
had been recorded by then, the cumulative byte counters, the schedule's hit / miss counters, the worker's
input waits and the store's usage. A step's figures are the differences between two marks, so they add up
exactly to the totals.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from runtime.core.events import StallEvent, StepEvent
from runtime.planning.measured_placement import first_step_listener
from runtime.planning.peak_hint import cuda_peak, reserve_probe
from runtime.profiler.analysis import summarize
from runtime.profiler.outputs import SavedProfile, save_profile
from runtime.profiler.records import Counters, RawProfile, StepMark
from runtime.session import placement_asker, placement_figures
from runtime.update.worker import WorkerStats
from tierstore import TierName, TransferEvent

if TYPE_CHECKING:
    from runtime.session import OffloadSession

log = logging.getLogger(__name__)

DEFAULT_MAX_EVENTS = 500_000  # transfers (and stalls) kept for the trace; counters keep counting past it


class Profiler:
    """Swap-traffic profiler of one offload session: what moved where, how fast, and why the GPU waited.

    ``ceilings`` are the bandwidths (GB/s, 1e9 bytes) each path can reach -- keys "h2d", "d2h", "read",
    "write" -- e.g. from :func:`runtime.profiler.measure_ceilings` or a ``tierstore bench store`` JSON through
    :func:`runtime.profiler.ceilings_from_store_bench`; a path without one is reported without a ratio.

    Use::

        profiler = Profiler(optimizer.session, ceilings).start()
        ...train...
        profiler.stop(); profiler.save("profile/")
    """

    def __init__(self, session: OffloadSession, ceilings: Mapping[str, float] | None = None,
                 max_events: int = DEFAULT_MAX_EVENTS):
        self.session = session
        self.ceilings_gbps = {str(k): float(v) for k, v in (ceilings or {}).items()}
        self.max_events = max_events
        self._lock = threading.Lock()  # held only to append / count: never across a transfer or a wait
        self._transfers: list[TransferEvent] = []
        self._stalls: list[StallEvent] = []
        self._marks: list[StepMark] = []
        self._counters = Counters()
        self._dropped = 0
        self._t0_s = 0.0
        self._end_s: float | None = None
        self._window_begin_s: float | None = None
        self._last_commit_s = 0.0
        self._interval_start = 0  # worker intervals before start() belong to nobody's profile
        self._hits0 = self._misses0 = 0
        self._wait_inputs0 = 0.0
        # The worker's split of its update time (adam_split) at start() and, once stopped, at stop().
        self._adam_split0: dict[str, float] = {}
        self._adam_split_end: dict[str, float] | None = None
        self._restore_intervals = False
        self._unsubscribe: Any = None
        self._meta: dict[str, Any] = {}
        self._meta_placement: Any = None  # the session's placement when _meta was taken (adopted after a first step)
        # torch.cuda.max_memory_allocated at start and at the last commit: the steps' peak is known when it rose
        # above what setup reached (None off a GPU)
        self._gpu_peak_at_start: int | None = None
        self._gpu_peak: int | None = None

    # ---- lifetime ------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """True between start() and stop()."""
        return self._unsubscribe is not None

    def start(self) -> Profiler:
        """Subscribe to the store's bus and the controller's hooks; turns on the worker's interval record."""
        if self.running:
            raise RuntimeError("the profiler is already running")
        controller = self.session.controller
        self._meta, self._meta_placement = session_meta(self.session), self.session.placement
        self._gpu_peak_at_start = self._gpu_peak = _gpu_peak_now(self.session)
        schedule = controller.schedule.stats
        self._hits0, self._misses0 = schedule.hits, schedule.misses
        self._wait_inputs0 = controller.worker.stats.wait_inputs_s
        self._adam_split0, self._adam_split_end = adam_split(controller.worker.stats), None
        self._restore_intervals = not controller.worker.record_intervals
        controller.worker.record_intervals = True  # the worker reads the flag per job: no restart needed
        self._interval_start = len(controller.worker.stats.intervals)
        self._t0_s = self._last_commit_s = time.perf_counter()
        self._end_s = None
        controller.stall_listeners.append(self._on_stall)
        controller.step_listeners.append(self._on_step)
        self._unsubscribe = self.session.store.bus.subscribe(self._on_transfer)
        log.info("profiler started")
        return self

    def stop(self) -> None:
        """Unsubscribe everything (idempotent). Call after the last transfers of interest have completed
        (e.g. after ``session.close()``), so the totals hold every byte the store moved."""
        if not self.running:
            return
        self._unsubscribe()
        self._unsubscribe = None
        controller = self.session.controller
        if self._on_stall in controller.stall_listeners:
            controller.stall_listeners.remove(self._on_stall)
        if self._on_step in controller.step_listeners:
            controller.step_listeners.remove(self._on_step)
        if self._restore_intervals:
            controller.worker.record_intervals = False
        self._adam_split_end = adam_split(controller.worker.stats)  # as the intervals, which stop being recorded
        self._end_s = time.perf_counter()

    def __enter__(self) -> Profiler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- listeners (any thread for transfers; the training thread for stalls and steps) --------------
    def _on_transfer(self, event: TransferEvent) -> None:
        with self._lock:
            self._counters.add(event.kind, event.nbytes, event.duration_s)
            if len(self._transfers) < self.max_events:
                self._transfers.append(event)
            else:
                self._dropped += 1

    def _on_stall(self, event: StallEvent) -> None:
        with self._lock:
            if len(self._stalls) < self.max_events:
                self._stalls.append(event)
            else:
                self._dropped += 1

    def _on_step(self, event: StepEvent) -> None:
        if event.kind == "drop":  # the dropped attempt is not the next step's compute
            self._window_begin_s = None
            return
        if event.kind == "begin":
            if event.signature == "train" and self._window_begin_s is None:
                self._window_begin_s = event.time_s
            return
        if event.kind != "commit":
            return
        controller = self.session.controller
        begin = self._window_begin_s if self._window_begin_s is not None else self._last_commit_s
        ends = controller.stats.backward_end_s
        backward_end = ends[-1] if ends and ends[-1] >= begin else event.time_s
        usage = {tier: figures["used_nbytes"] for tier, figures in self.session.store.usage().items()}
        first_step = first_step_listener(controller.step_listeners)
        measured = first_step.measured_steps if first_step is not None else 0
        # A placement adopted at this commit took this long after it: the next step starts after it.
        placing = first_step.placing_s.get(event.step, 0.0) if first_step is not None else 0.0
        # placed after measured steps, or one more measured (a recompute trial, or none adopted): the meta says so
        if self.session.placement is not self._meta_placement or self._meta.get("placement_steps", 0) != measured:
            self._meta, self._meta_placement = session_meta(self.session), self.session.placement
        if self._gpu_peak_at_start and first_step is not None and first_step.started:
            self._gpu_peak_at_start = 0  # the peak statistics were reset when the first step began: all is the steps'
        self._gpu_peak = _gpu_peak_now(self.session)
        stats = controller.schedule.stats
        with self._lock:
            mark = StepMark(event.step, begin, backward_end, event.time_s, len(self._transfers), len(self._stalls),
                            self._counters.copy(), stats.hits - self._hits0, stats.misses - self._misses0,
                            controller.worker.stats.wait_inputs_s - self._wait_inputs0, usage, placing)
            self._marks.append(mark)
        self._window_begin_s = None
        self._last_commit_s = event.time_s + placing

    # ---- results -------------------------------------------------------------------------------------
    def raw(self) -> RawProfile:
        """A consistent snapshot of what was recorded so far (copies of the lists; cheap)."""
        controller = self.session.controller
        stats = controller.schedule.stats
        intervals = controller.worker.stats.intervals[self._interval_start :]  # slicing is atomic
        split = self._adam_split_end if self._adam_split_end is not None else adam_split(controller.worker.stats)
        split = split if self._adam_split0 else {}  # never started: nothing of the worker's belongs to this profile
        with self._lock:
            return RawProfile(
                t0_s=self._t0_s, end_s=self._end_s if self._end_s is not None else time.perf_counter(),
                transfers=list(self._transfers), stalls=list(self._stalls), adam=list(intervals), marks=list(self._marks),
                counters=self._counters.copy(), hits=stats.hits - self._hits0, misses=stats.misses - self._misses0,
                wait_inputs_s=controller.worker.stats.wait_inputs_s - self._wait_inputs0, dropped_events=self._dropped,
                meta=self._meta_with_peak(), ceilings_gbps=dict(self.ceilings_gbps),
                adam_split_s={k: v - self._adam_split0.get(k, 0.0) for k, v in split.items()})

    def _meta_with_peak(self) -> dict[str, Any]:
        """The session's metadata with the steps' GPU peak and, under auto placement, the reserve it supports."""
        meta = dict(self._meta)
        if not meta:
            return meta
        peak = self._gpu_peak if self._gpu_peak and self._gpu_peak > (self._gpu_peak_at_start or 0) else None
        memory = {**meta.get("memory", {}), "gpu_peak_nbytes": peak}
        memory["reserve_probe"] = None if peak is None else reserve_probe(
            meta.get("config") or {}, peak, self.session.planned_blocks, placement_asker(self.session))
        meta["memory"] = memory
        return meta

    def summary(self) -> dict[str, Any]:
        """The machine-readable summary (what summary.json holds), advice included."""
        return summarize(self.raw())

    def save(self, directory: str | Any, trace: bool = True, plot: bool = True) -> SavedProfile:
        """Write summary.json, report.txt, trace.json (``trace``) and plot.png (``plot``, when matplotlib is
        importable; otherwise the skip is logged and listed) under directory."""
        return save_profile(self.raw(), directory, trace=trace, plot=plot)


def adam_split(stats: WorkerStats) -> dict[str, float]:
    """The worker's cumulative seconds in the AdamW kernel, in widening narrow host gradients and multiplying
    gradients by clip factors, and in
    refreshing compute weights (parts of its update time; pre-commit updates' kernels are not split out)."""
    return {"kernel_s": stats.kernel_s, "scale_s": stats.scale_s, "refresh_s": stats.refresh_s}


def _gpu_peak_now(session: OffloadSession) -> int | None:
    device = session.store.device
    if device.type != "cuda":
        return None
    return cuda_peak(device)()


def session_meta(session: OffloadSession) -> dict[str, Any]:
    """What advice needs to know about the session: device, the config's knobs, blocks, memory."""
    import psutil

    cfg = session.config
    controller = session.controller
    store = session.store
    blocks = session.planned_blocks  # this process's own (every block, in one process)
    homes = dict(session.plan.homes)  # kind -> tier; "host+nvme" when placement.moments: auto spilled some
    moment_nbytes = sum(store.record(b.key(kind)).meta.nbytes for b in blocks if b.index not in controller.gpu_updated
                        for kind in ("exp_avg", "exp_avg_sq") if store.record(b.key(kind)).home is TierName.NVME)
    device = store.device
    if device.type == "cuda":
        import torch

        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = "CPU (no CUDA)"
    usage = store.usage()
    first_step = first_step_listener(controller.step_listeners)
    return {
        "device": device_name,
        "device_type": device.type,
        # steps that ran before auto placement was adopted (measured, every update on the CPU): not steady
        "placement_steps": first_step.measured_steps if first_step is not None else 0,
        "nvme_io_mode": store.nvme_io_mode,
        "config": {
            "prefetch_depth": cfg.prefetch.depth,
            "prefetch_budget_nbytes": int(cfg.prefetch.budget),
            "io_threads": cfg.tiers.nvme.io_threads,
            "gpu_update_fraction": controller.options.gpu_update_fraction,  # `auto` resolved
            "accumulation_steps": cfg.optimizer.accumulation_steps,
            "cpu_threads": controller.options.cpu_threads,
            "weight_source": controller.options.weight_source.value,
            "host_grad_itemsize": controller.options.host_grad_dtype.itemsize,  # optimizer.host_grad_dtype resolved
            "moment_dtype": controller.options.moment_dtype,  # how the moments are stored (their bytes on every path)
            # the layers' activations recomputed in the backward (placement.activations), as the session runs now
            "activations_recomputed": session.activations_recomputed,
            "homes": homes,
            "host_budget_nbytes": usage.get(TierName.HOST.value, {}).get("capacity_nbytes", 0),
            **placement_figures(session),  # the GPU budget; auto or not, the activation reserve, plan bytes, keep
        },
        "blocks": [{"index": b.index, "name": b.name, "numel": b.numel, "weight_nbytes": controller.weights.nbytes(b.index),
                    "source_key": controller.weights.source_key(b), "gpu_updated": b.index in controller.gpu_updated,
                    "gpu_streamed": b.index in controller.gpu_streamed}
                   for b in blocks],
        "memory": {"host_available_nbytes": int(psutil.virtual_memory().available),
                   "moments_offloaded_nbytes": int(moment_nbytes)},
    }
