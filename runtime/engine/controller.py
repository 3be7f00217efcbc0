"""The offload runtime's controller: what happens at each hook, in one place.

It owns the store, the blocks, the weight manager, the prefetch schedule and the update worker, and keeps
the step bookkeeping (micro-batches, committed optimizer steps, the fp16 loss scale, clipping norms).
``runtime.model.hooks`` calls into it; ``runtime.model.optimizer`` drives ``step``. The device's share of the update
(device-updated and streamed blocks) is ``runtime.update.device_updates``; clipping is ``runtime.engine.clipping``; the
gradients held on the device until the commit are ``runtime.engine.held_grads``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runtime.config.units import approx_size
from runtime.core.blocks import Block
from runtime.core.events import STALL_CAPACITY, STALL_FETCH_HOST, STALL_FETCH_NVME, STALL_GRAD_SUM, STALL_UPDATE, StallEvent, StepEvent
from runtime.engine.clipping import GradClipper, real_grad
from runtime.engine.held_grads import HeldGrads
from runtime.engine.host_sums import HostGradSums
from runtime.engine.kept_grads import KeptGrads
from runtime.engine.schedule import PrefetchSchedule
from runtime.engine.spill_return import bring_moments_home
from runtime.engine.step_phase import StepPhase, check_phase_transition
from runtime.engine.weights import WeightManager
from runtime.engine.writeback import DeviceWritebacks
from runtime.model.materialize import ParamInit, initialize
from runtime.planning.auto_placement import STATE_ITEMSIZE, gpu_streamed_blocks, gpu_updated_blocks
from runtime.planning.memory_plan import MOMENT_KINDS, WeightSource
from runtime.update.adam import AdamWHyper, scale_slots, split_views
from runtime.update.device_updates import DeviceUpdates
from runtime.update.worker import STATE_KINDS, JobPhase, UpdateJob, UpdateWorker
from tierstore import CapacityError, Handle, TensorMeta, TierName, TierStore, close_at_exit, wait_at_exit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeOptions:
    """What the controller needs from the config, resolved (no 'auto' left)."""

    compute_dtype: torch.dtype
    weight_source: WeightSource
    homes: dict[str, TierName]  # kind -> home tier: master, exp_avg, exp_avg_sq, grad, weights
    hyper: AdamWHyper
    grad_clip: float | None
    accumulation_steps: int
    prefetch_depth: int
    prefetch_budget_nbytes: int
    loss_scale: dict[str, float] | None  # initial, growth_factor, backoff_factor, growth_interval (fp16)
    cpu_threads: int
    record_intervals: bool = False
    gpu_update_fraction: float = 0.0  # share of parameters (first blocks) whose AdamW runs on the device
    host_sums: bool = False  # micro-batch gradients of host-updated blocks summed in host memory (runtime.engine.host_sums)
    host_grad_dtype: torch.dtype = torch.float32  # of the host gradient buffers (optimizer.host_grad_dtype)
    gpu_stream_fraction: float = 0.0  # share (next blocks) updated on the device over state streamed from host
    gpu_stream_ahead: int = 8  # streamed blocks whose state may be brought in ahead of the block in backward
    spilled_blocks: frozenset[int] = frozenset()  # blocks whose moments live on NVMe though homes says host
    keep_for_backward_nbytes: int = 0  # weights a training forward may leave on the device for its backward
    hold_updates: bool = False  # updates wait for optimizer.step() (the user's loop clips: optimizer.user_grad_clip)
    speculate: bool = True  # the plan counts second state buffers: updates that wait for the commit may run early


STATS_HISTORY = 1024  # entries kept of per-step statistics
SETUP_PROGRESS_S = 10.0  # seconds between progress lines while blocks are registered (init, first writes)


@dataclass
class StepStats:
    """Counters of the step in progress / the last step, for logs and the profiler."""

    wait_update_s: float = 0.0  # host time blocked on the worker (an update not yet done)
    wait_fetch_s: float = 0.0  # host time blocked on weight fetches issued on demand
    # perf_counter at the end of each recent backward, and recent clipping norms: bounded, a run may be long.
    backward_end_s: deque[float] = field(default_factory=lambda: deque(maxlen=STATS_HISTORY))
    skipped_steps: int = 0
    grad_norms: deque[float] = field(default_factory=lambda: deque(maxlen=STATS_HISTORY))
    # Steps whose updates waited for the commit without running early: the step before them would have
    # redone its early updates (it clipped or overflowed), so this one was not expected to keep them.
    speculation_paused: int = 0
    early_updates: int = 0  # host updates queued to run before their commit (each is published or redone)
    early_reads: int = 0  # spilled blocks whose moments were read from NVMe during the micro-batches, before the commit
    held_grads: int = 0  # host-updated blocks whose gradient waited on the device and was scaled there ([Note: held gradients])


class Controller:
    """Drives fetch / release / gradient offload / update for one model."""

    def __init__(self, model: nn.Module, blocks: list[Block], store: TierStore, options: RuntimeOptions,
                 init: ParamInit | None = None, uninitialized: set[int] | None = None):
        self.model = model
        self.blocks = blocks
        self.store = store
        self.options = options
        self.device = store.device
        self.gpu_updated = gpu_updated_blocks(blocks, options.gpu_update_fraction)
        self.gpu_streamed = gpu_streamed_blocks(blocks, options.gpu_update_fraction, options.gpu_stream_fraction)
        self._register_state(options, init, uninitialized or set())
        try:
            self._start(options)
        except BaseException:  # offload() gives the parameters back and closes the store; the threads are ours
            self._stop_started()
            raise

    def _start(self, options: RuntimeOptions) -> None:
        """The setup past the state's registration: weight manager, schedule, optimizer worker, host sums."""
        blocks, store = self.blocks, self.store
        self.weights = WeightManager(blocks, store, options.compute_dtype, options.weight_source, self.gpu_updated)
        for block in blocks:
            if block.index in self.gpu_updated:
                self.weights.load_resident(block.index, store.tensor(block.key("master"), TierName.GPU))
            elif options.weight_source is WeightSource.RESIDENT:
                self.weights.load_resident(block.index)
        # Per-parameter step counters of device-updated blocks live on the device, as fused AdamW wants.
        self.gpu_param_steps = {i: [torch.zeros((), dtype=torch.float32, device=self.device) for _ in blocks[i].slots]
                                for i in self.gpu_updated | self.gpu_streamed}
        self.schedule = PrefetchSchedule(options.prefetch_depth, options.prefetch_budget_nbytes, self.weights.nbytes,
                                         fetched=lambda index: index not in self.gpu_updated)
        torch.set_num_threads(options.cpu_threads)
        # The optimizer worker needs the GIL for a moment between its kernels while the training thread
        # runs Python (hooks, kernel launches) almost without pause; at the default 5 ms switch interval
        # every such moment can cost 5 ms. Restored at close().
        self._switch_interval = sys.getswitchinterval()
        self.closed = False  # close() ran: the tiers are freed, the model is a plain module again
        self._commit_hypers: list[AdamWHyper] | None = None  # the groups as a commit read them (block_hypers)
        # The model's parameters offload() left out (frozen then), by name: one unfrozen since is refused
        # (refuse_unfrozen) rather than silently never updated.
        self.frozen: list[tuple[str, torch.nn.Parameter]] = []
        sys.setswitchinterval(min(self._switch_interval, 0.0005))
        self.worker = UpdateWorker(blocks, store, options.hyper, self.weights, record_intervals=options.record_intervals)
        self.param_block = {id(slot.param): block.index for block in blocks for slot in block.slots}
        self.param_slot = {id(slot.param): (block.index, position) for block in blocks for position, slot in enumerate(block.slots)}
        # AdamW hyper-parameters of each parameter group, read when a block's update is queued (the optimizer's
        # param_groups), and the group of each block's parameters.
        self.hyper_source: Callable[[], list[AdamWHyper]] = lambda: [options.hyper]
        self.slot_groups: list[list[int]] = [[0] * len(block.slots) for block in blocks]
        self.clipper = GradClipper(self)
        self.kept_grads = KeptGrads([len(block.slots) for block in blocks])  # zero_grad(set_to_none=False)
        self.optimizer_step = 0  # committed optimizer steps
        self.micro = 0  # backward passes since the last committed step
        self.forward_running = False  # between the model's forward pre-hook and its post-hook (runtime.model.hooks)
        # Streaming updates: the parameter groups' values as this step's first update read them, and whether a
        # later change was reported (_warn_if_hypers_changed_since_backward).
        self._hypers_read: list[AdamWHyper] | None = None
        self._warned_hypers = False
        self._warned_stale_step = False  # said once: a step() with no backward where plain PyTorch re-applies
        # Layer blocks acquired by a forward recomputed inside a backward (activation checkpointing: the model's own
        # where its hooks see it, or runtime.model.recompute's), counted over the session. A head or a loss recomputed by
        # the model does not count: its layers may still be worth recomputing.
        self.recomputed_acquires = 0
        self._phase = StepPhase.IDLE  # where the step in progress is (runtime.engine.step_phase); set only by _set_phase
        self._interrupted: str | None = None  # while INTERRUPTED: why the blocks are at different steps
        self._placement_broken = False  # a failed placement change left state on the device: no load mends it
        self._grad_counts = [0] * len(blocks)
        self._in_backward_use = [False] * len(blocks)
        self._grad_only_use: set[int] = set()  # blocks a backward that is no micro-batch holds (on_grad_only_backward)
        self._deferred_jobs: list[UpdateJob] = []
        self.held = HeldGrads(self.device)  # [Note: held gradients]
        # Whether this step's host gradients may be held: where a clip (ours or the user's) may scale them.
        self._hold_grads = self._holds_at_all and (options.grad_clip is not None or options.hold_updates)
        self._updating: set[int] = set()  # blocks whose update of the pending step has been submitted
        self._wanted: set[int] = set()  # blocks the forward wants but whose update had not landed yet
        self.worker.on_updated = self.on_block_updated
        hosted = self.host_updated_blocks
        # Spilled blocks whose moments are read early (see _read_spilled_early), in the order deferred updates run;
        # none when the master lives on NVMe too: the first updates would need the room for their masters.
        self._spilled_in_update_order = sorted(options.spilled_blocks) if options.homes["master"] is not TierName.NVME else []
        self._read_early: set[int] = set()  # spilled blocks whose moments this step read early
        self.sums: HostGradSums | None = None  # [Note: host gradient sums]
        if options.host_sums and options.accumulation_steps > 1 and hosted:
            self.sums = HostGradSums(store, hosted, dtype=options.host_grad_dtype)
            close_at_exit(self.sums, HostGradSums.close)  # its thread stops before the store it sums into
        # Registered after the worker and the sums, so it runs first at interpreter exit: a training thread the
        # program did not join finishes before they close under it (Python joins it only after those hooks).
        self.driver: threading.Thread | None = None  # the thread that last began a forward or called step()
        wait_at_exit(self, lambda controller: None if controller.closed else controller.driver)
        self.stats = StepStats()
        # Optional observers (the profiler). Empty lists cost one truth test per wait / step boundary.
        self.stall_listeners: list[Callable[[StallEvent], None]] = []
        self.step_listeners: list[Callable[[StepEvent], None]] = []
        self._capacity_refused: set[int] = set()  # blocks whose prefetch the GPU budget refused (only with listeners)
        self._kept: dict[int, int] = {}  # blocks a training forward left on the device for backward -> bytes, oldest first
        self._carried: set[int] = set()  # blocks a backward left on the device for the next micro-batch's forward
        self.writebacks = DeviceWritebacks(self.device)  # streamed state on its way home ([Note: paced write-back])
        self.pace_writebacks = True  # False queues each write-back at once (the bench's -nopace rows compare)
        self.device_updates = DeviceUpdates(self)  # the device-updated and streamed blocks' updates
        self.scaler: _LossScaler | None = None
        if options.loss_scale is not None:
            self.scaler = _LossScaler(self.device, **options.loss_scale)  # type: ignore[arg-type]
        self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        # Whether this step's host updates run before its commit (runtime.update.speculation): as long as the last
        # commit kept (or would have kept) every early result. A run whose norm exceeds the clip every step
        # would otherwise redo every early update, and the early runs take the cores and memory bandwidth
        # that the backward's copies and the redo need.
        self._speculate_this_step = True

    # ---- setup ---------------------------------------------------------------------------------------
    def _register_state(self, options: RuntimeOptions, init: ParamInit | None, uninitialized: set[int]) -> None:
        """Register every block's master (from the model's current values, or filled by ``init`` for
        parameters materialised from the meta device), moments, host gradient and compute-dtype weights
        copy (when that is the weight source) in the store. Each block's host parameters are freed as soon
        as the block is in the store, so the model never exists twice on the host.

        The pinned state is packed at the arena's end in forward order (``PinnedArena.packed_at_end``): the first
        blocks, the ones a placement adopted after the first step moves to the GPU, then free room next to the
        arena's free room, where spilled moments come back (``runtime.engine.spill_return``)."""
        homes = {block.index: self._state_homes(block, options) for block in self.blocks}
        host = self.store.tiers[TierName.HOST]
        pinned = sum(host.arena.reserved_size(meta.nbytes) for block_homes in homes.values()  # type: ignore[attr-defined]
                     for meta, home in block_homes.values() if home is TierName.HOST)
        start = reported = time.perf_counter()
        with host.arena.packed_at_end(pinned):  # type: ignore[attr-defined]  # the host tier is a HostTier
            for position, block in enumerate(self.blocks):
                if time.perf_counter() - reported >= SETUP_PROGRESS_S:  # a large model takes minutes: show progress
                    reported = time.perf_counter()
                    log.info("setting up block %d of %d (%.0f s so far)", position + 1, len(self.blocks), reported - start)
                fresh = [(slot.name, slot.param) for slot in block.slots if id(slot.param) in uninitialized]
                if fresh and init is not None:
                    initialize(fresh, init)
                master = torch.cat([slot.param.detach().reshape(-1).to(torch.float32) for slot in block.slots])
                for kind, (meta, home) in homes[block.index].items():  # keys without a value: zero-filled by the store
                    value = master if kind == "master" else master.to(meta.dtype) if kind == "weights" else None
                    self.store.register(block.key(kind), meta, home, init=value)
                # Only now: a registration that fails (a disk filling, Ctrl-C) leaves this block's values in the model,
                # and offload() gives back the blocks before it from the store.
                for slot in block.slots:
                    slot.param.data = torch.empty(0, dtype=slot.param.dtype, device=slot.param.device)

    def _state_homes(self, block: Block, options: RuntimeOptions) -> dict[str, tuple[TensorMeta, TierName]]:
        """The state a block keeps from setup, in registration order, with each key's size and home tier: master and
        moments (on the device for a device-updated block, the moments on NVMe for a spilled one), the host gradient
        (not for a device-updated or streamed block: its gradient never leaves the device) and the compute-dtype
        weights copy (when that is the weight source, not for a device-updated block: it casts from its master)."""
        f32 = TensorMeta(torch.float32, block.numel)
        if block.index in self.gpu_updated:
            return {kind: (f32, TierName.GPU) for kind in STATE_KINDS}
        state = {"master": (f32, options.homes["master"])}
        for kind in MOMENT_KINDS:
            state[kind] = (f32, TierName.NVME if block.index in options.spilled_blocks else options.homes[kind])
        if block.index not in self.gpu_streamed:
            state["grad"] = (TensorMeta(options.host_grad_dtype, block.numel), TierName.HOST)
        if options.weight_source is WeightSource.WEIGHTS:
            state["weights"] = (TensorMeta(options.compute_dtype, block.numel), options.homes["weights"])
        return state

    def adopt_placement(self, update_fraction: float, stream_fraction: float, keep_for_backward_nbytes: int,
                        spilled_blocks: frozenset[int] | None = None) -> None:
        """Between steps, give the device a larger share of the update (``runtime.planning.measured_placement`` calls this
        after the first step): the first blocks ``update_fraction`` selects move their master and moments to the
        device and update there (their micro-batch gradients then sum on the device, not in host memory), the next
        ones ``stream_fraction`` selects stream their state for the update, and a forward keeps up to
        ``keep_for_backward_nbytes`` of weights for its backward. ``spilled_blocks``: the blocks whose moments are
        to stay on NVMe (None: those spilled now, less the ones moved to the device); the other spilled blocks'
        moments come back to pinned memory as far as its room allows (``runtime.engine.spill_return``). Waits for every
        committed update first. The device's share only grows (a block updated on the device stays there) and the
        spill only shrinks."""
        updated = gpu_updated_blocks(self.blocks, update_fraction)
        streamed = gpu_streamed_blocks(self.blocks, update_fraction, stream_fraction)
        spilled_now = self.options.spilled_blocks
        staying = (spilled_now if spilled_blocks is None else spilled_blocks) - updated
        if self._phase is not StepPhase.IDLE:
            raise RuntimeError(f"a placement changes only between steps (the step is {self._phase.value})")
        if not self.gpu_updated <= updated or not self.gpu_streamed <= updated | streamed:
            raise RuntimeError("a placement change may only give the device more blocks to update")
        if not staying <= spilled_now:
            raise RuntimeError("a placement change may only bring spilled moments back to host memory")
        if streamed & spilled_now:  # a streamed update copies its moments from pinned memory
            raise RuntimeError("a placement change cannot stream blocks whose moments are spilled to NVMe")
        self.synchronize()
        self.wait_device_writebacks()
        for index, state in enumerate(self.weights.states):  # fetched weights: fetched again as the new placement says
            if state.users == 0:
                self._release(index)
        self.device_updates.fresh.clear()
        if self.device.type == "cuda":  # weight refreshes and fetches may still read host masters that move below
            torch.cuda.synchronize(self.device)
        arriving = sorted(updated - self.gpu_updated)
        need = sum(STATE_ITEMSIZE * self.blocks[i].numel + (0 if self.weights.states[i].resident else self.weights.nbytes(i))
                   for i in arriving)
        gpu = self.store.tiers[TierName.GPU]
        if need > gpu.free_nbytes:  # checked first: a block moved half-way would be neither here nor there
            raise CapacityError("gpu", need, gpu.used_nbytes, gpu.capacity_nbytes,
                                f"the master and moments of {len(arriving)} more device-updated blocks")
        leaving_cpu = sorted((updated | streamed) - self.gpu_updated - self.gpu_streamed)
        asked_back = spilled_now - updated - staying
        log.info("placement change: %d blocks' master and moments move to the GPU (%s with their compute weights), %d "
                 "more stream their update%s", len(arriving), approx_size(need), len(streamed - self.gpu_streamed),
                 f"; the moments of {len(asked_back)} spilled blocks are asked back from NVMe" if asked_back else "")
        # Device step counters first: after the move nothing may fail for want of device memory.
        steps = {i: [count.to(self.device, copy=True) for count in self.worker.param_steps[i]] for i in leaving_cpu}
        self._move_state_to_device(arriving)
        try:  # past the move nothing is expected to fail; should it, the blocks are neither here nor there
            for index in leaving_cpu:
                block = self.blocks[index]
                self.worker.spares.drop(index)  # no longer updated on the CPU
                self.gpu_param_steps[index] = steps[index]
                if self.sums is not None:  # its micro-batches now sum on the device
                    self.sums.release(index)
                if self.store.has(block.key("grad")):  # its gradient no longer leaves the device
                    self.store.unregister(block.key("grad"))
            if self.sums is not None and not self.sums.blocks:  # nothing left to sum on the host: its buffers go too
                self.sums.close()
                self.sums = None
            for index in arriving:
                if self.store.has(self.blocks[index].key("weights")):  # cast from the device master from now on
                    self.store.unregister(self.blocks[index].key("weights"))
        except BaseException as error:
            self._interrupted = (f"a placement change failed after moving blocks to the device ({error!r}); start a "
                                 "new process from the last checkpoint")
            self._placement_broken = True
            self._set_phase(StepPhase.INTERRUPTED)
            raise
        self.gpu_updated, self.gpu_streamed = updated, streamed
        self.weights.gpu_updated = updated
        # Spilled blocks stay where they are unless they fit (it never raises): the placement is adopted either way.
        spilled = bring_moments_home(self.store, self.blocks, sorted(asked_back), staying)
        self.options = dataclasses.replace(self.options, gpu_update_fraction=update_fraction,
                                           gpu_stream_fraction=stream_fraction,
                                           keep_for_backward_nbytes=keep_for_backward_nbytes, spilled_blocks=spilled)
        if self._spilled_in_update_order:
            self._spilled_in_update_order = sorted(spilled)
        self.device_updates.placement_changed()

    def _move_state_to_device(self, indices: list[int]) -> None:
        """Move these blocks' master and moments home to the device tier and make their compute weights resident,
        cast from it; all or nothing: a failure (the device out of memory) puts back what had moved, then raises."""
        moved: list[tuple[str, TierName]] = []
        resident: list[int] = []
        try:
            for index in indices:
                for kind in STATE_KINDS:
                    key = self.blocks[index].key(kind)
                    home = self.store.record(key).home
                    self.store.move_home(key, TierName.GPU)
                    moved.append((key, home))
            for index in indices:
                if not self.weights.states[index].resident:
                    resident.append(index)
                self.weights.load_resident(index, self.store.tensor(self.blocks[index].key("master"), TierName.GPU))
        except BaseException:
            for index in resident:
                self.weights.release(index)
            stuck = []
            # Every key goes back, even past one that cannot, in the order it left: the host arena places first fit,
            # so the same order and sizes fill the ranges they left or lower ones (in reverse, a small key can split
            # a large one's).
            for key, home in moved:
                try:
                    self.store.move_home(key, home)
                except Exception as undo_error:  # its host room was just freed: not expected
                    log.error("%s could not go back to %s after a failed placement change: %s", key, home.value, undo_error)
                    stuck.append(key)
            if stuck:  # the session cannot go on: every later step refuses, saying why
                self._interrupted = (f"a failed placement change left {', '.join(stuck)} on the device while the "
                                     "block updates on the CPU; start a new process from the last checkpoint")
                self._placement_broken = True
                self._set_phase(StepPhase.INTERRUPTED)
            raise

    # ---- forward -------------------------------------------------------------------------------------
    @property
    def last_micro(self) -> bool:
        """True when the backward in progress (or next) is the last before an optimizer step."""
        return self.micro == self.options.accumulation_steps - 1

    def on_step_begin(self) -> None:
        """The model's forward starts: close the previous trace and open one for this signature."""
        self.check_not_interrupted()
        self.driver = threading.current_thread()
        cut = self.weights.cut_off()
        if cut:
            raise RuntimeError(
                f"offloaded parameter{'s' if len(cut) > 1 else ''} {', '.join(cut[:3])}{' ...' if len(cut) > 3 else ''} "
                f"no longer use{'' if len(cut) > 1 else 's'} tierstore's memory (`param.set_(...)`, or another swap of "
                "its storage): the forward would compute with values no update reaches. Write new values with "
                "param.copy_(...) or load_state_dict, or set them before offload()")
        if torch.is_grad_enabled():
            refuse_unfrozen(self.frozen, lambda p: p.requires_grad, "requires a gradient")
        if self._phase is StepPhase.BACKWARD:  # the last backward raised and the user carried on: drop its step
            log.warning("the previous backward did not finish (an exception?); its step is dropped")
            self.discard_pending()
        forward_raised = self.drop_raised_forward_holds()
        if forward_raised and self.micro == 0 and self.step_listeners:
            # The step's first forward raised (an out-of-memory error a loop retried, say): nothing was pending to
            # drop, but listeners measuring the step must start again here, as after a drop.
            self._emit(self.step_listeners, StepEvent("drop", self.optimizer_step, time.perf_counter()))
        if self._phase is StepPhase.READY:
            raise RuntimeError(
                "the model ran forward after the step's last backward (micro-batch "
                f"{self.options.accumulation_steps} of optimizer.accumulation_steps: {self.options.accumulation_steps})"
                " but before optimizer.step(): the blocks' updates for that step are under way. Call "
                "optimizer.step() first (an evaluation too runs after it), and set optimizer.accumulation_steps to "
                "the backward passes your loop makes per step() (a step() after fewer is fine)"
            )
        fresh, self.device_updates.fresh = self.device_updates.fresh, set()
        signature = "train" if torch.is_grad_enabled() and self.model.training else ("eval" if not torch.is_grad_enabled() else "grad-eval")
        self.schedule.begin(signature)
        # The last backward's carried blocks stay when this forward begins with them; any other leftover (prefetched
        # for a path not taken, or after anything that may have changed the weights) goes.
        carried, self._carried = self._carried & set(self.schedule.upcoming(self._wrap_limit)), set()
        self._grad_only_use.clear()  # a gradient-only backward that raised: its blocks go in the sweep below
        for index, state in enumerate(self.weights.states):
            if state.users == 0 and not self._in_backward_use[index] and index not in fresh and index not in carried:
                self._release(index)
        self.weights.release_refreshes()  # no-op, unless a backward that held them raised before its end
        self.writebacks.forward_begin()
        if signature == "train" and self.deferred:
            self.held.forward_begin(self._copies_in_flight_nbytes)
        if self.step_listeners:
            self._emit(self.step_listeners, StepEvent("begin", self.optimizer_step, time.perf_counter(), signature))
        self.forward_running = True

    def drop_raised_forward_holds(self) -> bool:
        """Outside a forward: blocks a forward that raised left held (their users counted, never released) are
        released. Returns whether there were any."""
        raised = False
        for index, state in enumerate(self.weights.states):
            if state.users:  # a forward raised inside this block: nothing else holds it
                state.users = 0
                self._release(index)
                raised = True
        return raised

    def on_forward_end(self) -> None:
        """The model's forward returned or raised (its post-hook runs either way)."""
        self.forward_running = False

    @property
    def pass_running(self) -> bool:
        """A forward or a backward of the model is under way now (a block still held by one that raised is not)."""
        return self.forward_running or torch._C._current_graph_task_id() != -1  # inside the autograd engine

    def acquire(self, indices: list[int], phase: str) -> None:
        """Blocks are about to be used: record the use, wait for their update and weights, prefetch ahead."""
        self.store.engine.poll()
        if phase == "fwd" and self._paces_forward and indices and torch.is_grad_enabled():
            self.writebacks.before_forward(indices[0])
        for index in indices:
            self.schedule.observe(index, phase)
            self._ready(index)
            if phase == "recompute":
                self.recomputed_acquires += self.blocks[index].is_layer
                # Activation checkpointing may stop a recomputation early (its forward hook never runs):
                # the weights are held until the block's gradients are done instead of by a user count.
                self._in_backward_use[index] = True
            else:
                self.weights.states[index].users += 1
        self._prefetch()

    def release_after_forward(self, indices: list[int], phase: str) -> None:
        """A module's forward ended: drop the weights unless the schedule needs them again soon."""
        if phase == "recompute":
            return  # held until the block's gradients are done (see acquire)
        for index in indices:
            state = self.weights.states[index]
            state.users -= 1
            if state.users == 0 and not self._in_backward_use[index] and not self.schedule.needed_within(index, self.options.prefetch_depth + 1):
                if not self._keep_for_backward(index):
                    self._release(index)

    def _keep_for_backward(self, index: int) -> bool:
        """Leave a block's weights on the device for the backward of this training forward, within
        prefetch.keep_for_backward bytes: the newest blocks stay (backward needs them first); older kept
        ones are released to make room."""
        budget = self.options.keep_for_backward_nbytes
        if not budget or not torch.is_grad_enabled() or index in self.gpu_updated \
                or self.options.weight_source is WeightSource.RESIDENT:
            return False
        nbytes = self.weights.nbytes(index)
        if nbytes > budget:
            return False
        self._kept[index] = nbytes
        while sum(self._kept.values()) > budget:
            oldest = next(iter(self._kept))
            self._release(oldest)
        return True

    def _release(self, index: int) -> None:
        self._kept.pop(index, None)
        self.weights.release(index)

    def _ready(self, index: int) -> None:
        if not self.worker.is_updated(index, self.optimizer_step):
            self._wanted.add(index)  # the worker fetches it the moment its update lands
        waited = self.worker.wait_updated(index, self.optimizer_step)
        self.stats.wait_update_s += waited
        if waited > 0.0 and self.stall_listeners:
            self._emit_stall(index, STALL_UPDATE, waited, time.perf_counter() - waited)
        if self.options.weight_source is WeightSource.RESIDENT:
            self.weights.wait_refresh(index)
            self.schedule.record_fetch(True)
            return
        # Only a block not fetched yet can miss; its cause is read before the on-demand fetch stages it.
        cause = self._fetch_stall_cause(index) if self.stall_listeners and not self.weights.is_fetched(index) else None
        t1 = time.perf_counter()
        hit = self.weights.wait(index)
        waited = time.perf_counter() - t1 if not hit else 0.0
        self.stats.wait_fetch_s += waited
        if not hit and cause is not None:
            self._emit_stall(index, cause, waited, t1)
        self.schedule.record_fetch(hit)

    def _fetch_stall_cause(self, index: int) -> str:
        """Why an on-demand fetch of block index would wait: a refused prefetch, NVMe staging, or a plain miss."""
        if index in self._capacity_refused:
            self._capacity_refused.discard(index)
            return STALL_CAPACITY
        key = self.weights.source_key(self.blocks[index])
        if self.store.record(key).home is TierName.NVME and not self.store.state(key, TierName.HOST).is_current:
            return STALL_FETCH_NVME
        return STALL_FETCH_HOST

    def _emit_stall(self, index: int, cause: str, seconds: float, start_s: float) -> None:
        self._emit(self.stall_listeners, StallEvent(index, cause, seconds, self.optimizer_step, start_s))

    @staticmethod
    def _emit(listeners: list[Callable[[Any], None]], event: object) -> None:
        for listener in list(listeners):
            try:
                listener(event)
            except Exception:  # an observer's bug must never break training
                log.exception("controller listener %r failed", listener)

    @property
    def _wrap_limit(self) -> int:
        """[Note: prefetch across micro-batches] The backward of a micro-batch that does not end the step fetches
        the next forward's first blocks once its own remaining blocks are fewer than the depth, and keeps its last
        ones (the forward's first): the forward is bound by the weights' copies (it computes a block faster than its
        fp32 master crosses PCIe), the copy engine idles at the backward's end, and without this the forward began by
        fetching again what the backward had just released. Up to depth + 1 blocks in all, the block in use among
        them: within the window the plan counts (depth + 2). In the usual order a block's gradients are done before
        the next block's backward begins, so the backward keeps the forward's first ``depth`` fetched blocks and
        fetches one more (``runtime.bench.train_bound`` counts ``depth``). The carried blocks are named at the
        backward's end (``_carried``) and only they survive the next forward's sweep of leftovers. No master
        changes between these micro-batches: updates start in the step's last backward, which wraps nothing, and
        ``step()`` releases every block it updates; ``discard_pending`` releases everything; state writes and
        checkpoint loads are refused while a step is pending."""
        return self.options.prefetch_depth + 1

    def _wraps(self) -> bool:
        """Whether the micro-batch in progress is followed by another of this step (see _wrap_limit)."""
        return self._phase is StepPhase.BACKWARD and not self.last_micro

    def _upcoming(self) -> list[int]:
        """The blocks to have on the device next: the schedule's, past this pass into the next where it wraps."""
        return self.schedule.upcoming(wrap_limit=self._wrap_limit if self._wraps() else 0)

    def _prefetch(self) -> None:
        if self.options.weight_source is WeightSource.RESIDENT:
            return
        for index in self._upcoming():
            if self.weights.is_fetched(index) or index in self._updating:
                continue
            if not self.worker.is_updated(index, self.optimizer_step):
                self._wanted.add(index)
                continue
            try:
                self.weights.fetch(index, prefetch=True)
            except CapacityError:
                if self.stall_listeners:
                    self._capacity_refused.add(index)
                return  # the GPU budget is full: fetch on demand later

    def on_block_updated(self, index: int) -> None:
        """Worker thread: block index's update just landed; fetch it now if the forward is waiting for it."""
        if index not in self._wanted or self.options.weight_source is WeightSource.RESIDENT:
            return
        self._wanted.discard(index)
        try:
            self.weights.fetch(index, prefetch=True)
        except CapacityError:
            if self.stall_listeners:
                self._capacity_refused.add(index)  # set.add is atomic: safe from the worker thread
            # the GPU budget is full: the forward fetches on demand

    # ---- backward ------------------------------------------------------------------------------------
    def on_backward_begin(self, indices: list[int]) -> None:
        """Gradients w.r.t. a module's outputs are ready: its backward is next."""
        begins = self._phase is not StepPhase.BACKWARD  # the first block of this backward
        if begins and self._phase is StepPhase.IDLE:
            self._warn_if_last_gradients_held("a backward")
        if begins:
            self._enter_backward()
        if self._paces_forward and begins:
            self.writebacks.forward_end()
        if begins and self.last_micro:
            self._begin_last_backward()
        if self.gpu_streamed and self.last_micro:
            self.writebacks.settle()
        if begins and self.deferred and self._spilled_in_update_order:
            self._read_spilled_early()
        for index in indices:
            self.schedule.observe(index, "bwd")
            self._in_backward_use[index] = True
            self._ready(index)
            if self.gpu_streamed and self.last_micro:
                self._stream_state_ahead_of(index)
        self._prefetch()

    def on_grad_only_backward(self, indices: list[int]) -> None:
        """A backward that accumulates into no offloaded parameter's ``.grad`` reaches a module (``runtime.model.hooks``):
        ``torch.autograd.grad`` of an input's gradient (a saliency map) or of the parameters' (which the user may
        assign to ``.grad`` and step with), ``backward(inputs=[x])``. Plain PyTorch's parameters and optimizer see
        nothing of it, so it is no micro-batch of the step: the phase stays. Its arithmetic needs the block's weights:
        they are held until the backward ends (``on_grad_only_backward_end``). After the step's last backward it is
        refused: the blocks' masters are then being updated for that step, and a fetch would read them half-way."""
        self.check_not_interrupted()
        if self._phase is StepPhase.READY:
            raise RuntimeError(
                "a backward that accumulates into no parameter (torch.autograd.grad, backward(inputs=...)) ran after "
                "the step's last backward, before optimizer.step(): the blocks' weights are being updated for that "
                "step. Take such gradients before that backward, or after optimizer.step()")
        for index in indices:
            self.schedule.observe(index, "bwd")
            self._grad_only_use.add(index)
            self._ready(index)
        self._prefetch()

    def on_grad_only_backward_end(self) -> None:
        """The backward of ``on_grad_only_backward`` ended: the blocks it held go, unless something else holds them (a
        training backward it ran inside, a forward) or the next forward wants them (``_carried``, a device update's
        fresh weights)."""
        held, self._grad_only_use = self._grad_only_use, set()
        for index in sorted(held):
            if self.weights.states[index].users == 0 and not self._in_backward_use[index] \
                    and index not in self._carried and index not in self.device_updates.fresh:
                self._release(index)

    def _begin_last_backward(self) -> None:
        """The backward that ends the step begins (or a short step ends early: ``_end_accumulation_early``): the
        room held gradients may take is measured now, and the streamed blocks' state starts to come in."""
        if self.deferred:
            self.held.begin(self._streamed_state_nbytes)
        if self.gpu_streamed:
            self.device_updates.begin_streaming()

    def _stream_state_ahead_of(self, index: int) -> None:
        """Backward runs in descending block order: block index's streamed state, then that of the ones it reaches
        next. When the updates wait for the commit (clipping, fp16) the state waits on the device too, so every copy
        must fit the memory the backward freed; at the commit only the update itself is left."""
        ahead = range(index, max(index - 1 - self.options.gpu_stream_ahead, -1), -1)
        self.device_updates.stream_in_order(ahead, always=0 if self.deferred else 2)

    def _read_spilled_early(self) -> None:
        """Updates that wait for the commit run in forward order, and each spilled block's update first reads its
        moments from NVMe. The moments of this step's updates are fixed since the last commit, so read the first
        spilled blocks' into the host staging room now, while the micro-batches compute: at the commit their updates
        find them in memory. Asked at every backward (a room still held by the last step's write-backs may be free
        by the next); a full room stops it quietly."""
        for index in self._spilled_in_update_order:
            staged, accepted = self.worker.stage(self.blocks[index], MOMENT_KINDS)
            self.stats.early_reads += staged
            if staged or accepted:
                self._read_early.add(index)
            if not accepted:
                return

    def _release_read_early(self) -> None:
        """A dropped step: the moments read early for its updates give their room back (they are clean copies)."""
        for index in sorted(self._read_early):
            for kind in MOMENT_KINDS:
                self.store.release_read_ahead(self.blocks[index].key(kind), TierName.HOST)
        self._read_early.clear()

    def on_param_grad(self, param: nn.Parameter) -> None:
        """One parameter's gradient is fully accumulated for this backward."""
        index = self.param_block.get(id(param))
        if index is None:
            return
        if self._phase is not StepPhase.BACKWARD:  # a backward whose first hook is a parameter's, not a block's
            try:
                self._enter_backward()
            except RuntimeError:  # refused before anything counted it: it must not reach the next step either
                with torch._C.DisableTorchFunctionSubclass():  # not through the guard: that is the user dropping
                    torch.Tensor.grad.__set__(param, None)    # the pending step's gradient (runtime.engine.clipping)
                raise
        self._grad_counts[index] += 1
        if self._grad_counts[index] == len(self.blocks[index].slots):
            self._block_grads_done(index)

    def on_backward_end(self) -> None:
        """The whole backward finished: handle blocks with missing gradients, then finish the micro-batch."""
        if self._phase is not StepPhase.BACKWARD:  # no hook of this backward entered it (a broken invariant)
            raise RuntimeError(f"a backward ended in step phase {self._phase.value}; its hooks never began it")
        for index, count in enumerate(self._grad_counts):
            if 0 < count < len(self.blocks[index].slots) or (count == 0 and self.last_micro):
                self._block_grads_done(index)
        self._grad_counts = [0] * len(self.blocks)
        self._in_backward_use = [False] * len(self.blocks)
        if self._wraps():  # what the next forward finds on the device ([Note: prefetch across micro-batches])
            self._carried = {i for i in self._upcoming() if self.weights.is_fetched(i)}
        self.weights.release_refreshes()  # no-op unless a backward held them
        self._set_phase(StepPhase.READY if self.last_micro else StepPhase.ACCUMULATING)
        self.micro += 1
        self.stats.backward_end_s.append(time.perf_counter())

    def _block_grads_done(self, index: int) -> None:
        block = self.blocks[index]
        self._grad_counts[index] = len(block.slots)  # a block is finished once per backward
        self._in_backward_use[index] = False
        if self.last_micro:
            self._offload_grads(block)
        elif self.sums is not None and self.sums.holds(index):
            self._send_to_host_sum(block)
        state = self.weights.states[index]
        if state.users == 0 and index not in self.device_updates.fresh and not self._kept_for_next_forward(index):
            self._release(index)

    def _kept_for_next_forward(self, index: int) -> bool:
        """The block's weights stay for the next micro-batch's forward, which needs them among its first blocks
        ([Note: prefetch across micro-batches])."""
        return self._wraps() and index in self._upcoming()

    def _assemble(self, block: Block, present: list[bool], begin: int = 0, end: int | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Elements ``[begin, end)`` (default: all) of the block's flat gradient, as a new device tensor of ``dtype``
        (zeros for parameters not ``present``), taken off the parameters: a parameter's ``.grad`` is dropped once its
        last element is in."""
        end = block.numel if end is None else end
        flat = torch.empty(end - begin, dtype=dtype, device=self.device)
        with torch.no_grad():
            for slot, has in zip(block.slots, present):
                low, high = max(begin, slot.offset), min(end, slot.offset + slot.numel)
                if low < high:
                    view = flat[low - begin : high - begin]
                    if has:
                        view.copy_(slot.param.grad.reshape(-1)[low - slot.offset : high - slot.offset])
                    else:
                        view.zero_()
                if slot.offset + slot.numel <= end:  # all of it is in (or was, in an earlier piece)
                    _take_grad(slot.param)
        return flat

    def host_sum_holds(self, slot: tuple[int, int]) -> bool:
        """Between micro-batches: parameter ``slot`` has a gradient summed in host memory this step."""
        return self.sums is not None and self._phase is StepPhase.ACCUMULATING and self.sums.has_grad(*slot)

    def host_sum_of(self, slot: tuple[int, int]) -> torch.Tensor:
        """Between micro-batches: parameter ``slot``'s gradient summed in host memory so far (in the host gradient
        dtype, in the parameter's shape), once every piece sent for its block has landed. A view of the sum itself: what is
        written into it is what the step updates with."""
        index, position = slot
        assert self.sums is not None
        self.sums.wait_landed(index)
        param = self.blocks[index].slots[position]
        summed = self.store.tensor(self.blocks[index].key("grad"), TierName.HOST)
        return summed[param.offset : param.offset + param.numel].view(param.shape)

    def drop_host_sum(self, slot: tuple[int, int]) -> None:
        """``p.grad`` assigned between micro-batches (``model.zero_grad()``): the parameter's host sum of the step
        so far is dropped, as plain PyTorch drops its accumulated ``.grad`` (no-op unless sums run on the host)."""
        if self.sums is not None and self._phase in (StepPhase.ACCUMULATING, StepPhase.READY):
            self.sums.drop(*slot)

    def _send_to_host_sum(self, block: Block) -> None:
        """A micro-batch that does not end the step: the block's gradient, in the host gradient dtype, joins its host
        sum a piece at a time (the GPU holds the pieces in flight, not a second copy of the block's gradient)."""
        present = [slot.param.grad is not None for slot in block.slots]
        if not any(present):
            return
        self.wait_block_current(block.index)  # [Note: the gradient buffer waits]
        start = time.perf_counter()
        try:
            waited = self.sums.add_pieces(  # type: ignore[union-attr]
                block, lambda begin, end: self._assemble(block, present, begin, end, self.sums.dtype), present)
        finally:  # a piece that failed: the gradients go all the same, as after a whole one
            for slot in block.slots:
                _take_grad(slot.param)
        if waited > 0.0 and self.stall_listeners:
            self._emit_stall(block.index, STALL_GRAD_SUM, waited, start)

    def _offload_grads(self, block: Block) -> None:
        """Assemble the block's gradient on the device (fp32, or the host gradient dtype for a host-updated block;
        adding the host sum of the step's earlier micro-batches when there is one), check / unscale / take fp32
        norms, copy it to host (or hold it on the device until the commit: [Note: held gradients] in
        runtime.engine.held_grads)."""
        present = [slot.param.grad is not None for slot in block.slots]
        if not self.deferred and self._hypers_read is None:  # streaming: the step's updates take the groups as now
            self._hypers_read = self.hyper_source()
        earlier = self.sums.finish(block.index) if self.sums is not None and self.sums.holds(block.index) else None
        self._updating.add(block.index)  # its master is about to change: no prefetch until the step commits
        has_grad = present if earlier is None else [a or b for a, b in zip(present, earlier)]
        has_grad = self.kept_grads.merge(block.index, has_grad)  # zeros where zero_grad(set_to_none=False) kept them
        step = self.optimizer_step + 1
        on_device = block.index in self.gpu_updated or block.index in self.gpu_streamed
        if not on_device:
            # [Note: the gradient buffer waits] The last committed update of the block reads its host gradient
            # buffer, which this step's gradient (or host sum) is about to fill. A forward's fetch of the block
            # waited for that update already; a block no forward used did not (a zero gradient kept by
            # zero_grad(set_to_none=False), a gradient assigned by hand, a step() with no backward).
            self.wait_block_current(block.index)
        if not any(has_grad) and on_device:
            self.device_updates.submit(block, None, has_grad, step)
            return
        if not any(has_grad):
            job = UpdateJob(block, None, step, self.block_hypers(block), skip=True)
        else:
            # Parameters without any gradient: excluded below. A host gradient narrower than fp32 is the gradient
            # as backward computed it (nothing is rounded), or the plain loop's sum of it (_add_host_sum).
            flat = self._assemble(block, present, dtype=torch.float32 if on_device else self.options.host_grad_dtype)
            with torch.no_grad():
                if earlier is not None:  # g_last + sum: addition commutes, so the plain loop's bits in its dtype
                    self._add_host_sum(block, flat)
                views = [v for v, present in zip(split_views(flat, [s.numel for s in block.slots]), has_grad) if present]
                if self.scaler is not None:
                    torch._amp_foreach_non_finite_check_and_unscale_(views, self.found_inf, self.scaler.inv_scale())
                # Updates that wait for the commit keep each gradient's norm: clipping (ours or the user's).
                self.clipper.record(block, has_grad, _fp32_norms(views) if self.deferred else None)
            if on_device:
                self.device_updates.submit(block, flat, has_grad, step)
                return
            job = UpdateJob(block, None, step, self.block_hypers(block), mask=None if all(has_grad) else has_grad)
            job.speculative = self.deferred and self._speculates(block)
            held = (self.deferred and not job.speculative and self._hold_grads
                    and self.held.try_hold(block.index, flat))
            if not held:
                job.grad_handle = self._grad_to_host(block, flat)
        if not self.deferred:
            self.worker.submit(job)
            return
        self._deferred_jobs.append(job)
        if job.speculative:  # runs now, out of place; the commit publishes or redoes it
            self.stats.early_updates += 1
            self.worker.submit(job)

    @property
    def _holds_at_all(self) -> bool:
        """Whether host gradients are ever held on the device: not where they are narrower than fp32, since the clip's
        product must reach AdamW unrounded (the CPU scales the widened gradient)."""
        return self.options.host_grad_dtype == torch.float32

    def _add_host_sum(self, block: Block, flat: torch.Tensor) -> None:
        """Add the block's host gradient sum into its flat gradient on the device (the same dtype), brought in a piece
        at a time (``sums.piece_numel``): the GPU holds one piece beside the gradient, not a second copy of it."""
        summed = self.store.tensor(block.key("grad"), TierName.HOST)
        step = self.sums.piece_numel  # type: ignore[union-attr]
        for begin in range(0, block.numel, step):
            end = min(block.numel, begin + step)
            flat[begin:end].add_(summed[begin:end].to(self.device, non_blocking=True))

    def _speculates(self, block: Block) -> bool:
        """Deferred mode: block's host update runs before the commit this step (runtime.update.speculation)."""
        return self.options.speculate and self._speculate_this_step and self.worker.spares.can_speculate(block)

    def _grad_to_host(self, block: Block, flat: torch.Tensor) -> Handle:
        """Copy block's gradient into its host buffer (ordered after the work that produced it)."""
        return self.store.engine.d2h(block.key("grad"), flat, self.store.tensor(block.key("grad"), TierName.HOST))

    @property
    def host_updated_blocks(self) -> list[Block]:
        """The blocks whose update runs on the CPU: neither updated on the device nor streamed to it."""
        return [b for b in self.blocks if b.index not in self.gpu_updated and b.index not in self.gpu_streamed]

    @property
    def _streamed_state_nbytes(self) -> int:
        """Device bytes of every streamed block's master and moments ([Note: held gradients])."""
        return sum(self.store.record(self.blocks[i].key(kind)).meta.nbytes for i in self.gpu_streamed for kind in STATE_KINDS)

    def block_hypers(self, block: Block) -> list[AdamWHyper]:
        """Each of block's parameters' AdamW hyper-parameters, as its parameter group holds them now."""
        groups = self._commit_hypers if self._commit_hypers is not None else self.hyper_source()
        return [groups[g] for g in self.slot_groups[block.index]]

    def _copies_in_flight_nbytes(self) -> int:
        """Device bytes still held by copies to host that nobody has seen land (write-backs, held gradients)."""
        self.writebacks.settle()
        return self.writebacks.held_nbytes()

    @property
    def _paces_forward(self) -> bool:
        """Copies off the device may be in flight when a training forward starts (streamed state written back,
        held gradients sent at the commit): the forward waits for them where a block would not fit
        ([Note: paced write-back])."""
        return bool(self.gpu_streamed) or self.deferred

    @property
    def deferred(self) -> bool:
        """Updates wait for the step's commit: the whole gradient decides them (clipping, fp16 overflow)."""
        return self.options.grad_clip is not None or self.scaler is not None or self.options.hold_updates

    def _finish_update_submission(self) -> None:
        """Deferred mode, at the commit: decide clip and skip, then release the updates, each side in forward
        order (the next forward needs the first blocks first; on the host the spilled blocks whose moments were read
        early go before them: ``_commit_order``): the host's, then the device's."""
        if not self.deferred:
            return
        skip = False
        if self.scaler is not None:
            skip = bool(self.found_inf.item())
        coef = None
        total = self.clipper.commit() if not skip else None
        if total is not None and self.options.grad_clip is not None:
            coef = torch.clamp(self.options.grad_clip / (total + 1e-6), max=1.0)
            self.stats.grad_norms.append(float(total))
        multiplier = None if coef is None else coef.to("cpu")
        try:
            # The groups are read once, before anything is queued: one that can't be read (a scheduler's bad
            # value) fails the commit with nothing changed, not after some blocks' updates (found by a fuzz).
            self._commit_hypers = self.hyper_source()
            scaled = self._send_held_grads(coef, skip)
        except BaseException:
            self._commit_hypers = None
            self.discard_pending()  # nothing was queued: the step is dropped, as after zero_grad()
            raise
        # The CPU's updates are the step's longest tail: its jobs go first, the device's updates after them.
        try:
            scales_host = self._submit_host_jobs(multiplier, skip, scaled)
            self.device_updates.run(coef, skip)
        except BaseException:
            self.discard_pending(broken=(
                f"the commit of step {self.optimizer_step + 1} failed after some of its updates were queued, so the "
                "blocks are at different steps. Restore the last checkpoint (runtime.checkpoint.state.load_checkpoint)"))
            raise
        finally:
            self._commit_hypers = None
        if not skip:  # hold the next step's host gradients where that saves a multiply: this step's is the guess
            self._hold_grads = self._holds_at_all and scales_host
        else:
            self.stats.skipped_steps += 1
            log.info("fp16 overflow: step %d skipped, loss scale %.1f -> %.1f", self.optimizer_step + 1,
                     float(self.scaler.scale), float(self.scaler.scale) * self.scaler.backoff_factor)  # type: ignore[union-attr]
        if self.scaler is not None:
            self.scaler.update(self.found_inf)
            self.found_inf.zero_()

    def _send_held_grads(self, coef: torch.Tensor | None, skip: bool) -> dict[int, Handle | None]:
        """Scale the held gradients on the device and copy them to host in the commit's order, ahead of the streamed
        state's write-backs on the copy engine ([Note: held gradients]). Returns each held block's copy (None
        for a skipped step, whose gradients simply go)."""
        held = self.held.take()
        self.stats.held_grads += len(held)
        scaled: dict[int, Handle | None] = {}
        # In the order the commit queues the updates: the copy engine lands them in that order.
        for index, flat in sorted(held.items(), key=lambda item: self._commit_order(item[0])):
            block = self.blocks[index]
            if not skip:
                scale_slots(flat, block, self.clipper.user_scales(block), coef)
                scaled[index] = self._grad_to_host(block, flat)
                # Kept alive until seen landed: its memory is in use until then, and the next forward paces itself
                # by it as by the streamed write-backs.
                self.writebacks.add(scaled[index], keep=flat)
            else:
                scaled[index] = None
        return scaled

    def _commit_order(self, index: int) -> tuple[bool, int]:
        """Block index's place in the order the commit queues host updates (and sends held gradients) in: the
        spilled blocks whose moments were read early first (the worker, which prefers them too, may take the first
        job before the next is queued), then forward order."""
        return index not in self._read_early, index

    def _submit_host_jobs(self, multiplier: torch.Tensor | None, skip: bool, scaled: dict[int, Handle | None]) -> bool:
        """Queue (or resolve, when they ran early) the host-updated blocks' updates (``_commit_order``), with the
        commit's verdict: clip factors (already applied to the ``scaled`` ones), skip, parameter groups. Returns
        whether any factor was other than 1 (a gradient that did not wait on the device was multiplied)."""
        would_hold, scaled_any = True, False
        # Each job leaves the list as it is queued or resolved: a commit that fails part-way leaves the rest to
        # discard_pending (speculative ones resolved there, never twice).
        for job in sorted(self._deferred_jobs, key=lambda job: self._commit_order(job.block.index)):
            scales = self.clipper.user_scales(job.block)
            keep = self.clipper.kept(job.block, job.mask or [True] * len(job.block.slots))
            final = dataclasses.replace(
                job, speculative=False, phase=JobPhase.QUEUED, verdict=None, grad_multiplier=multiplier,
                slot_multipliers=None if scales is None else [s if s is None else s.to("cpu") for s in scales],
                hypers=self.block_hypers(job.block),  # the param_groups as the commit finds them
                mask=None if all(keep) else keep, skip=job.skip or skip or not any(keep))
            holds = speculation_holds(job, final)
            would_hold = would_hold and (holds or job.skip)
            scaled_any = scaled_any or not (is_unit(final.grad_multiplier)
                                            and all(is_unit(f) for f in final.slot_multipliers or []))
            if job.block.index in scaled:  # already scaled on the device, on its way to host
                final = dataclasses.replace(final, grad_handle=scaled[job.block.index], grad_multiplier=None,
                                            slot_multipliers=None)
            if job.speculative:
                self.worker.resolve(job, holds, final)
            else:
                self.worker.submit(final)
            self._deferred_jobs = [j for j in self._deferred_jobs if j is not job]
            self._read_early.discard(job.block.index)  # its update uses (and frees) what was read early for it
        self._read_early.clear()
        if self.options.speculate:
            self.stats.speculation_paused += not self._speculate_this_step
            self._speculate_this_step = would_hold
        return scaled_any

    # ---- optimizer -----------------------------------------------------------------------------------
    def step(self) -> None:
        """Commit the optimizer step whose updates the last backward started."""
        self.check_not_interrupted()
        self.driver = threading.current_thread()
        had_backward = self._phase is not StepPhase.IDLE
        if self._phase is StepPhase.IDLE:
            self._warn_if_last_gradients_held("optimizer.step() with no backward")
            if not self._has_assigned_grads() and not self.kept_grads.zero_step_pending:
                return  # no backward and no gradient since the last step (or its step was dropped): like torch, nothing to do
            self._step_from_assigned_grads()
        if self._phase is StepPhase.ACCUMULATING:
            self._end_accumulation_early()
        if self._phase is StepPhase.BACKWARD:  # a backward started and did not end: it raised, and the loop went on
            raise RuntimeError(
                "optimizer.step() after a backward that did not finish (it raised): its gradients are partial. Call "
                "optimizer.zero_grad() to drop the step, as after any exception in forward or backward")
        if self._phase is not StepPhase.READY:
            raise RuntimeError(
                f"optimizer.step() called after {self.micro} backward pass(es); the config's "
                f"optimizer.accumulation_steps is {self.options.accumulation_steps}: call backward that many times per step"
            )
        self._warn_if_hypers_changed_since_backward()
        self._finish_update_submission()
        self.clipper.reset()
        self._set_phase(StepPhase.IDLE)
        for index in self._updating:  # a copy fetched for a read before the commit holds pre-step weights
            if self.weights.states[index].users == 0 and index not in self.device_updates.fresh:
                self._release(index)
        self._updating.clear()
        self._carried.clear()
        self.optimizer_step += 1
        self.micro = 0
        self.kept_grads.step_committed(had_backward)
        if self.step_listeners:
            self._emit(self.step_listeners, StepEvent("commit", self.optimizer_step, time.perf_counter()))

    def _warn_if_last_gradients_held(self, what: str) -> None:
        """A step() with no backward, or a step's first backward, with no ``zero_grad()`` (the optimizer's or the
        model's) since the last step: plain PyTorch's ``.grad`` tensors still hold that step's gradients, which it
        applies again, or adds the new ones to; here they were used up by that step's update. Said once a session."""
        if self._warned_stale_step or not self.kept_grads.last_gradients_held:
            return
        self._warned_stale_step = True
        effect = ("they are not applied again, where plain PyTorch applies them again" if what.startswith("optimizer.step")
                  else "its gradients start from zero, where plain PyTorch adds them to the last step's")
        log.warning("%s since the last step and no zero_grad() (the optimizer's or the model's) between them: the last "
                    "step's gradients went to its update, so %s (its .grad tensors still hold them). Call zero_grad() "
                    "after each step to make the two agree", what, effect)

    def _warn_if_hypers_changed_since_backward(self) -> None:
        """Streaming updates took the parameter groups' values (lr, betas, eps, weight_decay) as the backward found
        them; a change made after the backward, before ``step()``, applies from the next step, where plain
        PyTorch applies it to this one. Said once a session, not silently."""
        read, self._hypers_read = self._hypers_read, None
        if read is None or self._warned_hypers or read == self.hyper_source():
            return
        self._warned_hypers = True
        log.warning("optimizer.param_groups changed between backward() and step() (lr, betas, eps or weight_decay): "
                    "this step's updates started as its gradients landed and used the values the backward found; "
                    "the change applies from the next step. Change them before the forward (a scheduler's step() "
                    "after optimizer.step() does), or set optimizer.user_grad_clip: true so that updates wait for "
                    "optimizer.step() and read them there")

    def _end_accumulation_early(self) -> None:
        """``optimizer.step()`` after fewer backward passes than ``optimizer.accumulation_steps``: the HF Trainer's
        last step of an epoch whose micro-batches the accumulation does not divide, or a loop's last, short window.
        Plain PyTorch steps with the gradients summed so far; so does this. The step ends as its last micro-batch's
        backward would have ended it: every block's gradient summed so far (in ``.grad`` on the device, or in its
        host sum) is taken off now, in backward order, with the same calls a backward makes (the streamed blocks'
        state brought in ahead of its update, the held gradients' room measured now)."""
        log.info("optimizer.step() after %d of %d micro-batches: the step updates with the gradients summed so far",
                 self.micro, self.options.accumulation_steps)
        self._set_phase(StepPhase.BACKWARD)  # a backward's phase: p.grad reads the real gradient, not a host sum's
        self._take_grads_now()

    def note_zero_grad(self, set_to_none: bool) -> None:
        """``optimizer.zero_grad(set_to_none)`` is about to drop the gradients (before the pending step is discarded):
        with zeros kept, the parameters holding a gradient of the step in progress (on the device, or summed in host
        memory) keep a zeroed ``.grad`` in plain PyTorch, which the next step updates (``runtime.engine.kept_grads``)."""
        present = [] if set_to_none else [
            (index, position) for index, block in enumerate(self.blocks) for position, slot in enumerate(block.slots)
            if real_grad(slot.param) is not None
            or (self.sums is not None and self._phase.pending and self.sums.has_grad(index, position))]
        self.kept_grads.zero_grad(set_to_none, present)

    def _has_assigned_grads(self) -> bool:
        """Between steps, whether some offloaded parameter holds a real ``.grad``: one assigned by hand, since a
        backward's gradients leave the parameters for their update and a dropped step clears them."""
        return any(real_grad(slot.param) is not None for block in self.blocks for slot in block.slots)

    def _step_from_assigned_grads(self) -> None:
        """``optimizer.step()`` with no backward since the last step, but gradients in ``.grad`` that the user assigned
        (``p.grad = g`` after ``torch.autograd.grad(loss, params)``, or gradients made elsewhere), or zeros that
        ``zero_grad(set_to_none=False)`` kept (``runtime.engine.kept_grads``). Plain PyTorch steps with them; so does this,
        taking them off the parameters as a step's last backward would."""
        if self.scaler is not None and self._has_assigned_grads():
            raise RuntimeError(
                "optimizer.step() found gradients assigned to .grad by hand under fp16 loss scaling (dtype: fp16): "
                "tierstore divides a step's gradients by its loss scale, and these never carried it. Compute them "
                "with optimizer.scale_loss(loss).backward()")
        log.info("optimizer.step() with no backward since the last step: the step updates with the gradients "
                 "assigned to the parameters' .grad, and zero gradients where zero_grad(set_to_none=False) kept them")
        self._enter_backward()
        self._take_grads_now()

    def _take_grads_now(self) -> None:
        """End the step as its last micro-batch's backward would (``_end_accumulation_early``,
        ``_step_from_assigned_grads``): every block's gradient so far is taken off now, in backward order."""
        self.micro = self.options.accumulation_steps - 1  # the micro-batch that ends the step, for what follows
        self._in_backward_use = [False] * len(self.blocks)  # step() runs outside any backward
        self._begin_last_backward()
        for index in range(len(self.blocks) - 1, -1, -1):
            if self.gpu_streamed:
                self.writebacks.settle()
                self._stream_state_ahead_of(index)
            self._offload_grads(self.blocks[index])
        self.weights.release_refreshes()  # as at a backward's end: no-op unless the streamed state held them
        self._set_phase(StepPhase.READY)
        self.micro += 1

    def synchronize(self) -> None:
        """Block until every committed update has finished."""
        self.worker.synchronize(self.optimizer_step)

    # ---- between-step access (runtime.model.state_access) --------------------------------------------------
    @property
    def step_pending(self) -> bool:
        """True from the first backward of a step until optimizer.step() commits it."""
        return self._phase.pending

    def in_backward_use(self, index: int) -> bool:
        """True while block index's weights are held for a backward (or its recomputation)."""
        return self._in_backward_use[index]

    def release_block(self, index: int) -> None:
        """Free block index's fetched compute weights (no-op when in use or always resident)."""
        self._release(index)

    def update_under_way(self, index: int) -> bool:
        """True when block index's update of the pending step started before optimizer.step() (streaming)."""
        return index in self._updating and not self.deferred

    def wait_block_current(self, index: int) -> None:
        """Wait until block index's master holds the committed step's update."""
        self.worker.wait_updated(index, self.optimizer_step)

    def discard_pending(self, broken: str | None = None) -> None:
        """Drop the step in progress (zero_grad() before step(), or a caught exception in forward / backward),
        as plain PyTorch drops its gradients. Updates that wait for the commit never ran: nothing changes. With
        streaming updates some blocks may already be updated; then the next step refuses (see _interrupted).
        ``broken``: why the dropped step left blocks at different steps anyway (a commit that failed part-way);
        the next step refuses with it, and a checkpoint load mends it. A cleanup that fails itself (a copy that
        failed, say) leaves the session refusing the next step the same way, and the error is raised."""
        # CPU and device updates alike run as gradients land when they do not wait for the commit.
        interrupted = broken is not None or (bool(self._updating) and not self.deferred)
        if interrupted:
            started = len(self._updating)
            self._interrupt(broken or (
                (f"a step was abandoned after {started} of {len(self.blocks)} blocks had started their update "
                 "(updates start as gradients land), so the blocks are at different steps" if started < len(self.blocks)
                 else "a step was abandoned after every block's update had started (updates start as gradients "
                      "land): the weights and moments hold a step optimizer.step() never committed")
                + ". Restore the last checkpoint (runtime.checkpoint.state.load_checkpoint), "
                "or set optimizer.user_grad_clip: true so that updates wait for optimizer.step() "
                "and an abandoned step changes nothing"))
        speculative = [job for job in self._deferred_jobs if job.speculative]
        self._deferred_jobs, self.device_updates.pending = [], []
        self.held.drop()
        self._reset_step_counters()  # first: whatever fails below, a checkpoint load finds a step-free controller
        try:
            for job in speculative:
                self.worker.resolve(job, False, None)  # its result in the spares is simply never published
            if interrupted:
                # Updates of the dropped step already queued run to the end (the blocks are then at two steps,
                # which the next step refuses); nothing below may race them for the blocks' state (releases, a
                # checkpoint reading a swap file the worker is writing).
                self.worker.drain()
            self.wait_device_writebacks()  # updates of this step already written back stay (see _interrupted)
            for index in self.gpu_streamed:  # state brought in for the dropped step: clean copies, let them go
                for kind in STATE_KINDS:
                    self.store.release_read_ahead(self.blocks[index].key(kind), TierName.GPU)
            self.found_inf.zero_()
            if self.sums is not None:
                self.sums.reset()
            self._release_read_early()
            self._carried.clear()
            for index, state in enumerate(self.weights.states):
                state.users = 0
                self._release(index)
            self.weights.release_refreshes()
        except BaseException:
            if not interrupted:
                self._interrupt("dropping a step failed part-way, so the blocks' state may be at different steps. "
                                "Restore the last checkpoint (runtime.checkpoint.state.load_checkpoint)")
            raise
        if not interrupted:
            self._set_phase(StepPhase.IDLE)
        if self.step_listeners:
            self._emit(self.step_listeners, StepEvent("drop", self.optimizer_step, time.perf_counter()))

    def _interrupt(self, why: str) -> None:
        """The next step must refuse (with ``why``) until a checkpoint load puts every block at one step."""
        self._interrupted = why
        if self._phase is not StepPhase.INTERRUPTED:
            self._set_phase(StepPhase.INTERRUPTED)

    def _reset_step_counters(self) -> None:
        """Forget the step in progress: micro-batches, gradients taken, blocks updating; no copy, no wait."""
        self.micro = 0
        self._grad_counts = [0] * len(self.blocks)
        self._in_backward_use = [False] * len(self.blocks)
        self._updating.clear()
        self.device_updates.fresh.clear()
        self.clipper.reset()
        with torch._C.DisableTorchFunctionSubclass():  # not through the guard: no host sum to drop, no wait
            for block in self.blocks:  # gradients of non-final micro-batches still on the device
                for slot in block.slots:
                    torch.Tensor.grad.__set__(slot.param, None)

    def clear_interrupted(self) -> None:
        """Every block's state was just restored to one step (a checkpoint load): training may go on (not after a
        placement change that could not be undone: the state is where this controller does not look for it)."""
        if self._placement_broken:
            return
        if self._phase is StepPhase.INTERRUPTED:
            # A drop whose cleanup failed may have left these: the next step starts from none of the old one.
            self.found_inf.zero_()
            if self.sums is not None:
                self.sums.reset()
            self._set_phase(StepPhase.IDLE)
        self._interrupted = None

    def check_not_interrupted(self) -> None:
        """Raise when an abandoned step left blocks at different steps."""
        if self._phase is StepPhase.INTERRUPTED:
            raise RuntimeError(self._interrupted)

    def check_open(self) -> None:
        """Raise, saying what to do, when the optimizer is used after its session closed (it would change nothing
        or read freed state)."""
        if self.closed:
            raise RuntimeError(
                "this optimizer's offload session was closed (optimizer.session.close(), or the end of `with "
                "optimizer.session:`): its tiers were freed and the model is a plain module again. Save the optimizer "
                "state (optimizer.state_dict(), runtime.checkpoint.state.save_checkpoint) before closing; to train on, "
                "offload the model again (offload(model, config)) and load that state")

    @property
    def worker_error(self) -> BaseException | None:
        """What stopped the optimizer worker (an update that failed), or None while it runs."""
        return self.worker.error

    @property
    def interrupted(self) -> str | None:
        """Why the blocks are at different steps (an abandoned streaming step, a commit that failed part-way), or
        None when they are at one step."""
        return self._interrupted if self._phase is StepPhase.INTERRUPTED else None

    def _enter_backward(self) -> None:
        """A backward's first block: a micro-batch of the step in progress, or the step's first."""
        self.check_not_interrupted()
        if self._phase is StepPhase.READY:
            raise RuntimeError(
                "a backward ran after the last micro-batch's backward, before optimizer.step(): each block's gradient "
                "was taken off the parameters for its update when that backward reached it, so a second one could not "
                f"be added to the step. Call optimizer.step() (or zero_grad()) after every {self.options.accumulation_steps} "
                "backward pass(es), or raise optimizer.accumulation_steps to the number of backward passes per step")
        if self._phase is StepPhase.IDLE:  # a step's first backward: nothing of a dropped step's is read now
            self._hypers_read = None
        self._set_phase(StepPhase.BACKWARD)

    def _set_phase(self, phase: StepPhase) -> None:
        """The one place the step phase changes (checked against runtime.engine.step_phase's table)."""
        check_phase_transition(self._phase, phase)
        self._phase = phase

    @property
    def phase(self) -> StepPhase:
        """Where the step in progress is."""
        return self._phase

    def wait_device_writebacks(self) -> None:
        """Wait for streamed state still on its way back to host memory."""
        self.writebacks.wait_all()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss times the current fp16 loss scale (identity without loss scaling)."""
        return loss if self.scaler is None else loss * self.scaler.scale.to(loss.device)

    def _stop_started(self) -> None:
        """A setup that failed past the state's registration: stop the threads ``_start`` got to (each one tried,
        a failure logged: the setup's own error is what offload() raises)."""
        for part in (getattr(self, "sums", None), getattr(self, "worker", None), getattr(self, "weights", None)):
            if part is not None:
                try:
                    part.close()
                except Exception as error:
                    log.error("offload(): stopping %s after a failed setup failed too: %r", type(part).__name__, error)
        if hasattr(self, "_switch_interval"):
            sys.setswitchinterval(self._switch_interval)

    def close(self) -> None:
        """Stop the host sums and the worker (finishing queued updates)."""
        self.closed = True
        if self.sums is not None:
            self.sums.close()
        self.worker.close()
        self.weights.close()
        sys.setswitchinterval(self._switch_interval)


class _LossScaler:
    """Dynamic fp16 loss scaling with torch's own update rule (the one GradScaler uses)."""

    def __init__(self, device: torch.device, initial: float, growth_factor: float, backoff_factor: float, growth_interval: int):
        self.scale = torch.full((), float(initial), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = int(growth_interval)

    def inv_scale(self) -> torch.Tensor:
        """1/scale computed as GradScaler computes it (in double, then float)."""
        return self.scale.double().reciprocal().float()

    def update(self, found_inf: torch.Tensor) -> None:
        """Back off on overflow, grow after growth_interval clean steps."""
        torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf, self.growth_factor, self.backoff_factor, self.growth_interval)



def is_unit(factor: torch.Tensor | None) -> bool:
    """A clip factor that changes no bit: none, or exactly 1 (a CPU tensor)."""
    return factor is None or float(factor) == 1.0


def refuse_unfrozen(frozen: list[tuple[str, torch.nn.Parameter]], unfrozen: Callable[[torch.nn.Parameter], bool],
                    what: str) -> None:
    """Progressive unfreezing: a parameter frozen when offload() ran has no block and no Adam state, so a gradient
    on it would never be applied (plain AdamW over all the parameters trains it from then on). Raise, naming the
    parameters for which ``unfrozen`` holds, before anything of the step ran."""
    names = [name for name, p in frozen if unfrozen(p)]
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ValueError(
            f"{shown} {what} but {'was' if len(names) == 1 else 'were'} frozen (requires_grad=False) when offload() "
            "ran, so tierstore has no optimizer state for it and would never update it. Unfreeze every parameter "
            "that will train before offload() (freeze it again with requires_grad_(False) until its turn: an "
            "offloaded parameter without a gradient is not updated), or keep it frozen")


def speculation_holds(speculative: UpdateJob, final: UpdateJob) -> bool:
    """True when the update the commit decided (``final``) is the one a speculative run made: no skip, no clip
    factor but exactly 1 (multiplying by 1 changes no bit), the same parameters and hyper-parameters."""
    all_kept = [True] * len(final.block.slots)
    return (not final.skip and is_unit(final.grad_multiplier) and all(is_unit(s) for s in final.slot_multipliers or [])
            and final.hypers == speculative.hypers and (final.mask or all_kept) == (speculative.mask or all_kept))


def _fp32_norms(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's 2-norm computed and returned in fp32, whatever the gradients' dtype: the plain loop takes
    them from its fp32 masters' gradients, which hold the same values in fp32."""
    if views and views[0].dtype != torch.float32:
        return list(torch._foreach_norm(views, 2.0, dtype=torch.float32))
    return list(torch._foreach_norm(views, 2.0))


def _take_grad(param: nn.Parameter) -> None:
    """Take a gradient off its parameter for the step: not through the parameter guard, which would take it for the
    user dropping it (``GradClipper.on_grad_set``: plain PyTorch would then hold no ``.grad`` tensor for it)."""
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.grad.__set__(param, None)
