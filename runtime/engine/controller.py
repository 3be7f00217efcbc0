"""The offload runtime's controller: it receives the hooks' events and dispatches them, in order, to the engine's
parts, and moves the step's phase and counts.

``runtime.model.hooks`` calls into it; ``runtime.model.optimizer`` drives ``step``. It assembles the parts, each
handed the narrow collaborators it uses and a read-only ``StepView`` of the step (this controller): the blocks'
records (``block_state``), fetch / prefetch / release (``fetch``), a finished block's gradient (``gradients``), the
commit (``commit``), state registered and moved between tiers (``relocation``), clipping (``clipping``), the device's
share of the update (``runtime.update.device_updates``) and the host worker (``runtime.update.worker``).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

from runtime.core.blocks import Block
from runtime.core.events import StallEvent, StepEvent
from runtime.engine import refusals
from runtime.engine.block_state import BlockState, BlockTable, UpdateSite
from runtime.engine.clipping import GradClipper
from runtime.engine.commit import Commit
from runtime.engine.fetch import Fetcher
from runtime.engine.gradients import Gradients, HostSumSlots
from runtime.engine.held_grads import HeldGrads
from runtime.engine.host_sums import HostGradSums
from runtime.engine.hypers import StepHypers
from runtime.engine.kept_grads import KeptGrads
from runtime.engine.loss_scale import LossScaler
from runtime.engine.options import RuntimeOptions
from runtime.engine.refusals import refuse_unfrozen
from runtime.engine.relocation import Relocation, register_state
from runtime.engine.schedule import PrefetchSchedule
from runtime.engine.stats import StepStats, emit
from runtime.engine.step_phase import StepPhase, check_phase_transition
from runtime.engine.torch_calls import GRAD_SET
from runtime.engine.weights import WeightManager
from runtime.engine.writeback import DeviceWritebacks
from runtime.planning.auto_placement import gpu_streamed_blocks, gpu_updated_blocks
from runtime.planning.memory_plan import WeightSource
from runtime.update.adam import AdamWHyper
from runtime.update.device_updates import DeviceUpdates, DeviceUpdateSettings
from runtime.update.worker import UpdateWorker
from tierstore import TierName, TierStore, close_at_exit, wait_at_exit

__all__ = ["Controller", "RuntimeOptions", "StepStats", "refuse_unfrozen"]  # what other packages import from here

log = logging.getLogger(__name__)


class Controller:
    """Drives fetch / release / gradient offload / update for one model."""

    def __init__(self, model: nn.Module, blocks: list[Block], store: TierStore, options: RuntimeOptions,
                 fill_block: Callable[[Block], None] | None = None):
        self.model = model
        self.blocks = blocks
        self.store = store
        self.options = options
        self.device = store.device
        # One record per block: its update site and spill, and its place in the step in progress.
        # The placement's fractions count this process's blocks: all of them, or those it owns among several.
        owned = [block for block in blocks if block.index not in options.remote()]
        self.table = BlockTable(blocks, gpu_updated_blocks(owned, options.gpu_update_fraction),
                                gpu_streamed_blocks(owned, options.gpu_update_fraction, options.gpu_stream_fraction),
                                options.spilled_blocks, options.remote())
        register_state(store, blocks, self.table, options, fill_block)
        try:
            self._start(options)
        except BaseException:  # offload() gives the parameters back and closes the store; the threads are ours
            self._stop_started()
            raise

    def _start(self, options: RuntimeOptions) -> None:
        """The setup past the state's registration: the parts, the optimizer worker, host sums."""
        blocks, store = self.blocks, self.store
        self.weights = WeightManager(blocks, store, options.compute_dtype, options.weight_source, self.gpu_updated,
                                     options.ranks, options.owners)
        for block in blocks:
            if block.index in self.gpu_updated:
                self.weights.load_resident(block.index, store.tensor(block.key("master"), TierName.GPU))
            elif options.weight_source is WeightSource.RESIDENT:
                self.weights.load_resident(block.index)
        # Per-parameter step counters of device-updated blocks live on the device, as fused AdamW wants.
        self.gpu_param_steps = {i: [torch.zeros((), dtype=torch.float32, device=self.device) for _ in blocks[i].slots]
                                for i in self.gpu_updated | self.gpu_streamed}
        self.schedule = PrefetchSchedule(options.prefetch_depth, options.prefetch_budget_nbytes, self.weights.nbytes,
                                         fetched=lambda index: self.table[index].site is not UpdateSite.DEVICE)
        torch.set_num_threads(options.cpu_threads)
        # The optimizer worker needs the GIL for a moment between its kernels while the training thread
        # runs Python (hooks, kernel launches) almost without pause; at the default 5 ms switch interval
        # every such moment can cost 5 ms. Restored at close().
        self._switch_interval = sys.getswitchinterval()
        self.closed = False  # close() ran: the tiers are freed, the model is a plain module again
        # The model's parameters offload() left out (frozen then), by name: one unfrozen since is refused
        # (refuse_unfrozen) rather than silently never updated.
        self.frozen: list[tuple[str, torch.nn.Parameter]] = []
        sys.setswitchinterval(min(self._switch_interval, 0.0005))
        self.worker = UpdateWorker(blocks, store, options.hyper, self.weights, record_intervals=options.record_intervals,
                                   moment_dtype=options.moment_dtype, int8_kernel=options.int8_kernel)
        self.param_block = {id(slot.param): block.index for block in blocks for slot in block.slots}
        self.param_slot = {id(slot.param): (block.index, position) for block in blocks for position, slot in enumerate(block.slots)}
        self._param_state: dict[int, BlockState] = {id(slot.param): self.table[block.index] for block in blocks
                                                    for slot in block.slots}  # on_param_grad's one lookup
        # The AdamW hyper-parameters of each parameter group (the optimizer's param_groups) and each block's groups.
        self.hypers = StepHypers(options.hyper, blocks)
        self.kept_grads = KeptGrads([len(block.slots) for block in blocks])  # zero_grad(set_to_none=False)
        hosted = self.table.host_updated()
        sums = None  # [Note: host gradient sums]
        if options.host_sums and options.accumulation_steps > 1 and hosted:
            sums = HostGradSums(store, hosted, dtype=options.host_grad_dtype)
            close_at_exit(sums, HostGradSums.close)  # its thread stops before the store it sums into
        self.host_sums = HostSumSlots(self, blocks, store, sums)
        self.clipper = GradClipper(self, blocks, self.param_slot, self.kept_grads, self.host_sums)
        self.optimizer_step = 0  # committed optimizer steps
        # On a GPU, with several processes: by step, the event recorded after that commit's device work was queued
        # (its updates, their write-backs), which a read of the state from another thread waits for, and nothing
        # queued later (runtime.model.remote_reads). The last two steps' are kept: the CPU may have committed the
        # next step while its device work still waits for the rank reading.
        self._committed_events: dict[int, torch.cuda.Event] = {}
        self.micro = 0  # backward passes since the last committed step
        self.forward_running = False  # between the model's forward pre-hook and its post-hook (runtime.model.hooks)
        self._phase = StepPhase.IDLE  # where the step in progress is (runtime.engine.step_phase); set only by _set_phase
        self._interrupted: str | None = None  # while INTERRUPTED: why the blocks are at different steps
        self._placement_broken = False  # a failed placement change left state on the device: no load mends it
        self.held = HeldGrads(self.device)  # [Note: held gradients]
        # Spilled blocks' moments are read early (Commit.read_spilled_early), but not when the master lives on NVMe
        # too: the first updates would need the room for their masters.
        self._reads_early = options.homes["master"] is not TierName.NVME
        # Registered after the worker and the sums, so it runs first at interpreter exit: a training thread the
        # program did not join finishes before they close under it (Python joins it only after those hooks).
        self.driver: threading.Thread | None = None  # the thread that last began a forward or called step()
        wait_at_exit(self, lambda controller: None if controller.closed else controller.driver)
        self.stats = StepStats()
        # Optional observers (the profiler). Empty lists cost one truth test per wait / step boundary.
        self.stall_listeners: list[Callable[[StallEvent], None]] = []
        self.step_listeners: list[Callable[[StepEvent], None]] = []
        self.writebacks = DeviceWritebacks(self.device)  # streamed state on its way home ([Note: paced write-back])
        settings = DeviceUpdateSettings(options.weight_source, options.prefetch_depth, options.gpu_stream_ahead,
                                        self.deferred, self.gpu_updated, self.gpu_streamed, options.moment_dtype,
                                        options.int8_kernel)
        self.device_updates = DeviceUpdates(settings, blocks, store, self.weights, self.worker, self.writebacks,
                                            self.clipper, self.gpu_param_steps, self.hypers.block_hypers)
        self.scaler = None if options.loss_scale is None else LossScaler(self.device, **options.loss_scale)  # type: ignore[arg-type]
        self.fetch = Fetcher(self, self.table, blocks, store, self.weights, self.schedule, self.worker, self.writebacks,
                             self.stats, self.stall_listeners)
        self.worker.on_updated = self.fetch.on_block_updated
        self.grads = Gradients(self, self.table, blocks, store, self.worker, self.device_updates, self.clipper, self.held,
                               self.kept_grads, self.host_sums, self.hypers, self.scaler, self.writebacks, self.stats,
                               self.stall_listeners)
        self.commit = Commit(self, self.table, blocks, store, self.worker, self.device_updates, self.clipper, self.held,
                             self.writebacks, self.hypers, self.grads, self.scaler, self.stats, self.weights, self.fetch)
        self.relocation = Relocation(self, self.table, blocks, store, self.weights, self.worker, self.device_updates,
                                     self.writebacks, self.fetch, self.host_sums, self.gpu_param_steps, self._placement_failed)

    # ---- the placement (runtime.engine.relocation) ---------------------------------------------------------
    def adopt_placement(self, update_fraction: float, stream_fraction: float, keep_for_backward_nbytes: int,
                        spilled_blocks: frozenset[int] | None = None) -> None:
        """Between steps, give the device a larger share of the update (``runtime.planning.measured_placement`` calls
        this after the first step; ``Relocation.adopt`` says how)."""
        self.options = self.relocation.adopt(update_fraction, stream_fraction, keep_for_backward_nbytes, spilled_blocks)

    def _placement_failed(self, why: str) -> None:
        """A placement change left state where this controller does not look for it: every later step refuses."""
        self._interrupted = why
        self._placement_broken = True
        self._set_phase(StepPhase.INTERRUPTED)

    @property
    def gpu_updated(self) -> frozenset[int]:
        """Blocks whose master and moments live on the device and update there."""
        return self.table.gpu_updated

    @property
    def gpu_streamed(self) -> frozenset[int]:
        """Blocks updated on the device over state streamed in from host memory."""
        return self.table.gpu_streamed

    @property
    def host_updated_blocks(self) -> list[Block]:
        """The blocks whose update runs on the CPU: neither updated on the device nor streamed to it."""
        return self.table.host_updated()

    @property
    def sums(self) -> HostGradSums | None:
        """The host gradient sums ([Note: host gradient sums]), or None where none run."""
        return self.host_sums.sums

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
            raise refusals.cut_off(cut)
        if torch.is_grad_enabled():
            refuse_unfrozen(self.frozen, lambda p: p.requires_grad, "requires a gradient")
        if self._phase is StepPhase.BACKWARD:  # the last backward raised and the user carried on: drop its step
            log.warning("the previous backward did not finish (an exception?); its step is dropped")
            self.discard_pending()
        forward_raised = self.fetch.drop_raised_forward_holds()
        if forward_raised and self.micro == 0 and self.step_listeners:
            # The step's first forward raised (an out-of-memory error a loop retried, say): nothing was pending to
            # drop, but listeners measuring the step must start again here, as after a drop.
            emit(self.step_listeners, StepEvent("drop", self.optimizer_step, time.perf_counter()))
        if self._phase is StepPhase.READY:
            raise refusals.forward_after_last_backward(self.options.accumulation_steps)
        fresh, self.device_updates.fresh = self.device_updates.fresh, set()
        signature = "train" if torch.is_grad_enabled() and self.model.training else ("eval" if not torch.is_grad_enabled() else "grad-eval")
        self.schedule.begin(signature)
        self.fetch.sweep_leftovers(fresh)
        self.weights.release_refreshes()  # no-op, unless a backward that held them raised before its end
        self.writebacks.forward_begin()
        if signature == "train" and self.deferred:
            self.grads.forward_begin()
        if self.step_listeners:
            emit(self.step_listeners, StepEvent("begin", self.optimizer_step, time.perf_counter(), signature))
        self.forward_running = True

    def drop_raised_forward_holds(self) -> bool:
        """Outside a forward: release the blocks a forward that raised left held; returns whether there were any."""
        return self.fetch.drop_raised_forward_holds()

    def on_forward_end(self) -> None:
        """The model's forward returned or raised (its post-hook runs either way)."""
        self.forward_running = False

    @property
    def pass_running(self) -> bool:
        """A forward or a backward of the model is under way now (a block still held by one that raised is not)."""
        return self.forward_running or torch._C._current_graph_task_id() != -1  # inside the autograd engine

    def acquire(self, indices: list[int], phase: str) -> None:
        """Blocks are about to be used by a forward or its recomputation (``Fetcher.acquire``)."""
        self.fetch.acquire(indices, phase)

    def release_after_forward(self, indices: list[int], phase: str) -> None:
        """A module's forward ended (``Fetcher.release_after_forward``)."""
        self.fetch.release_after_forward(indices, phase)

    @property
    def recomputed_acquires(self) -> int:
        """Layer blocks acquired by a forward recomputed inside a backward, over the session."""
        return self.fetch.recomputed_acquires

    # ---- backward ------------------------------------------------------------------------------------
    def on_backward_begin(self, indices: list[int]) -> None:
        """Gradients w.r.t. a module's outputs are ready: its backward is next."""
        begins = self._phase is not StepPhase.BACKWARD  # the first block of this backward
        if begins and self._phase is StepPhase.IDLE:
            self.grads.warn_if_last_held("a backward")
        if begins:
            self._enter_backward()
        if self.fetch.paces_forward and begins:
            self.writebacks.forward_end()
        last_micro, streams = self.last_micro, bool(self.gpu_streamed)
        if begins and last_micro:
            self.grads.begin_last_backward()
        if streams and last_micro:
            self.writebacks.settle()
        if begins and self.deferred and self._reads_early and self.table.spilled_in_update_order:
            self.commit.read_spilled_early()
        for index in indices:
            self.schedule.observe(index, "bwd")
            held = self.fetch.held(index)  # (read before this acquire marks it)
            self.table[index].in_backward = True
            self.fetch.ready(index, held=held)
            if streams and last_micro:
                self.grads.stream_state_ahead_of(index)
        self.fetch.prefetch()

    def on_grad_only_backward(self, indices: list[int]) -> None:
        """A backward that accumulates into no offloaded parameter's ``.grad`` reaches a module (``runtime.model.hooks``):
        ``torch.autograd.grad`` of an input's gradient (a saliency map) or of the parameters' (which the user may
        assign to ``.grad`` and step with), ``backward(inputs=[x])``. Plain PyTorch's parameters and optimizer see
        nothing of it, so it is no micro-batch of the step: the phase stays. Its arithmetic needs the block's weights:
        they are held until the backward ends (``on_grad_only_backward_end``). After the step's last backward it is
        refused: the blocks' masters are then being updated for that step, and a fetch would read them half-way."""
        self.check_not_interrupted()
        if self._phase is StepPhase.READY:
            raise refusals.grad_only_after_last_backward()
        for index in indices:
            self.schedule.observe(index, "bwd")
            self.table[index].in_grad_only = True
            self.fetch.ready(index, held=self.fetch.held(index))
        self.fetch.prefetch()

    def on_grad_only_backward_end(self) -> None:
        """The backward of ``on_grad_only_backward`` ended: the blocks it held go, unless something else holds them (a
        training backward it ran inside, a forward) or the next forward wants them (carried, a device update's
        fresh weights)."""
        self.fetch.release_grad_only(self.device_updates.fresh)

    def on_param_grad(self, param: nn.Parameter) -> None:
        """One parameter's gradient is fully accumulated for this backward."""
        record = self._param_state.get(id(param))
        if record is None:
            return
        if self._phase is not StepPhase.BACKWARD:  # a backward whose first hook is a parameter's, not a block's
            try:
                self._enter_backward()
            except RuntimeError:  # refused before anything counted it: it must not reach the next step either
                with torch._C.DisableTorchFunctionSubclass():  # not through the guard: that is the user dropping
                    GRAD_SET(param, None)  # the pending step's gradient (runtime.engine.clipping)
                raise
        record.grads_done += 1
        if record.grads_done == record.num_slots:
            self._block_grads_done(record)

    def on_backward_end(self) -> None:
        """The whole backward finished: handle blocks with missing gradients, then finish the micro-batch."""
        if self._phase is not StepPhase.BACKWARD:  # no hook of this backward entered it (a broken invariant)
            raise RuntimeError(f"a backward ended in step phase {self._phase.value}; its hooks never began it")
        for record in self.table:
            count = record.grads_done
            if 0 < count < record.num_slots or (count == 0 and self.last_micro):
                self._block_grads_done(record)
        self.table.end_backward()
        self.fetch.carry_to_next_forward()  # [Note: prefetch across micro-batches]
        self.weights.release_refreshes()  # no-op unless a backward held them
        if self.last_micro:
            self.clipper.share_across_ranks()  # several processes, the loop clipping: every rank's norms (no-op else)
        self._set_phase(StepPhase.READY if self.last_micro else StepPhase.ACCUMULATING)
        self.micro += 1
        self.stats.backward_end_s.append(time.perf_counter())

    def _block_grads_done(self, record: BlockState) -> None:
        """A block's gradients of this backward are complete: send them on, and release its weights unless a
        forward, a device update's fresh cast or the next micro-batch's forward needs them."""
        index = record.index
        record.grads_done = record.num_slots  # a block is finished once per backward
        record.in_backward = False
        self.grads.block_done(record.block, self.last_micro)
        if self.weights.states[index].users == 0 and index not in self.device_updates.fresh \
                and not self.fetch.kept_for_next_forward(index):
            self.fetch.release(index)

    # ---- optimizer -----------------------------------------------------------------------------------
    @property
    def hyper_source(self) -> Callable[[], list[AdamWHyper]]:
        """Reads the optimizer's param_groups as AdamW hyper-parameters (``runtime.model.optimizer`` sets it)."""
        return self.hypers.source

    @property
    def pace_writebacks(self) -> bool:
        """False queues each device write-back at once (the bench's -nopace rows compare)."""
        return self.device_updates.pace_writebacks

    @pace_writebacks.setter
    def pace_writebacks(self, pace: bool) -> None:
        self.device_updates.pace_writebacks = pace

    @property
    def deferred(self) -> bool:
        """Updates wait for the step's commit: the whole gradient decides them (clipping, fp16 overflow)."""
        return self.options.grad_clip is not None or self.options.loss_scale is not None or self.options.hold_updates

    def step(self) -> None:
        """Commit the optimizer step whose updates the last backward started."""
        self.check_not_interrupted()
        self.driver = threading.current_thread()
        had_backward = self._phase is not StepPhase.IDLE
        if self._phase is StepPhase.IDLE:
            self.grads.warn_if_last_held("optimizer.step() with no backward")
            if not self.grads.has_assigned() and not self.kept_grads.zero_step_pending:
                return  # no backward and no gradient since the last step (or its step was dropped): like torch, nothing to do
            self._step_from_assigned_grads()
        if self._phase is StepPhase.ACCUMULATING:
            self._end_accumulation_early()
        if self._phase is StepPhase.BACKWARD:  # a backward started and did not end: it raised, and the loop went on
            raise refusals.step_after_raised_backward()
        if self._phase is not StepPhase.READY:
            raise refusals.step_count_mismatch(self.micro, self.options.accumulation_steps)
        self.hypers.warn_if_changed_since_backward()
        self.fetch.drop_kept_for_next()  # (a forward with no backward before this step: its last block's hold ends)
        self.commit.run(self.discard_pending)
        self.weights.drop_gathers()  # broadcasts started ahead and not used: the weights change now
        self.clipper.reset()
        self._set_phase(StepPhase.IDLE)
        for index in self.table.updating():  # a copy fetched for a read before the commit holds pre-step weights
            if self.weights.states[index].users == 0 and index not in self.device_updates.fresh:
                self.fetch.release(index)
        for record in self.table:
            record.updating = False
            record.carried = False
        if self.options.ranks is not None and self.device.type == "cuda":
            self._committed_events[self.optimizer_step + 1] = torch.cuda.current_stream(self.device).record_event()
            self._committed_events.pop(self.optimizer_step - 1, None)
        self.optimizer_step += 1
        self.micro = 0
        self.kept_grads.step_committed(had_backward)
        if self.step_listeners:
            emit(self.step_listeners, StepEvent("commit", self.optimizer_step, time.perf_counter()))

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
        """``optimizer.zero_grad(set_to_none)`` is about to drop the gradients (``Gradients.note_zero_grad``)."""
        self.grads.note_zero_grad(set_to_none)

    def _step_from_assigned_grads(self) -> None:
        """``optimizer.step()`` with no backward since the last step, but gradients in ``.grad`` that the user assigned
        (``p.grad = g`` after ``torch.autograd.grad(loss, params)``, or gradients made elsewhere), or zeros that
        ``zero_grad(set_to_none=False)`` kept (``runtime.engine.kept_grads``). Plain PyTorch steps with them; so does this,
        taking them off the parameters as a step's last backward would."""
        if self.scaler is not None and self.grads.has_assigned():
            raise refusals.assigned_grads_under_loss_scaling()
        log.info("optimizer.step() with no backward since the last step: the step updates with the gradients "
                 "assigned to the parameters' .grad, and zero gradients where zero_grad(set_to_none=False) kept them")
        self._enter_backward()
        self._take_grads_now()

    def _take_grads_now(self) -> None:
        """End the step as its last micro-batch's backward would (``_end_accumulation_early``,
        ``_step_from_assigned_grads``): every block's gradient so far is taken off now, in backward order."""
        self.micro = self.options.accumulation_steps - 1  # the micro-batch that ends the step, for what follows
        for record in self.table:  # step() runs outside any backward
            record.in_backward = False
        self.grads.begin_last_backward()
        self.grads.take_all()
        self.weights.release_refreshes()  # as at a backward's end: no-op unless the streamed state held them
        self.clipper.share_across_ranks()
        self._set_phase(StepPhase.READY)
        self.micro += 1

    def committed_event(self, step: int) -> torch.cuda.Event | None:
        """On a GPU with several processes: the event recorded after commit ``step``'s device work was queued (None
        elsewhere, or for a step more than one behind)."""
        return self._committed_events.get(step)

    def param_steps(self, block_index: int) -> list[torch.Tensor]:
        """The AdamW step counters of a block's parameters (the tensors themselves: a load fills them): the device's
        for a block updated there, else the update worker's."""
        return self.gpu_param_steps.get(block_index) or self.worker.param_steps[block_index]

    def synchronize(self) -> None:
        """Block until every committed update has finished."""
        self.worker.synchronize(self.optimizer_step)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss times the current fp16 loss scale (identity without loss scaling)."""
        return loss if self.scaler is None else self.scaler.scale_loss(loss)

    # ---- between-step access (runtime.model.state_access) --------------------------------------------------
    @property
    def step_pending(self) -> bool:
        """True from the first backward of a step until optimizer.step() commits it."""
        return self._phase.pending

    def in_backward_use(self, index: int) -> bool:
        """True while block index's weights are held for a backward (or its recomputation), or for the next acquire
        ([Note: held blocks are not broadcast again])."""
        return self.table[index].in_backward or self.fetch.is_kept_for_next(index)

    def update_under_way(self, index: int) -> bool:
        """True when block index's update of the pending step started before optimizer.step() (streaming)."""
        return self.table[index].updating and not self.deferred

    # ---- dropping a step -----------------------------------------------------------------------------------
    def discard_pending(self, broken: str | None = None) -> None:
        """Drop the step in progress (zero_grad() before step(), or a caught exception in forward / backward),
        as plain PyTorch drops its gradients. Updates that wait for the commit never ran: nothing changes. With
        streaming updates some blocks may already be updated; then the next step refuses (see _interrupted).
        ``broken``: why the dropped step left blocks at different steps anyway (a commit that failed part-way);
        the next step refuses with it, and a checkpoint load mends it. A cleanup that fails itself (a copy that
        failed, say) leaves the session refusing the next step the same way, and the error is raised."""
        # CPU and device updates alike run as gradients land when they do not wait for the commit.
        started = len(self.table.updating())
        interrupted = broken is not None or (started > 0 and not self.deferred)
        if interrupted:
            self._interrupt(broken or refusals.abandoned_step(started, len(self.blocks)))
        speculative = self.commit.forget_pending()  # first: whatever fails below, a checkpoint load finds no step
        self.fetch.drop_kept_for_next()
        self.micro = 0
        try:
            self.commit.release_pending(speculative, interrupted)
        except BaseException:
            if not interrupted:
                self._interrupt("dropping a step failed part-way, so the blocks' state may be at different steps. "
                                "Restore the last checkpoint (runtime.checkpoint.state.load_checkpoint)")
            raise
        if not interrupted:
            self._set_phase(StepPhase.IDLE)
        if self.step_listeners:
            emit(self.step_listeners, StepEvent("drop", self.optimizer_step, time.perf_counter()))

    def _interrupt(self, why: str) -> None:
        """The next step must refuse (with ``why``) until a checkpoint load puts every block at one step."""
        self._interrupted = why
        if self._phase is not StepPhase.INTERRUPTED:
            self._set_phase(StepPhase.INTERRUPTED)

    def clear_interrupted(self) -> None:
        """Every block's state was just restored to one step (a checkpoint load): training may go on (not after a
        placement change that could not be undone: the state is where this controller does not look for it)."""
        if self._placement_broken:
            return
        if self._phase is StepPhase.INTERRUPTED:
            self.commit.clear_overflow_and_sums()  # a drop whose cleanup failed may have left these
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
            raise refusals.session_closed()

    @property
    def worker_error(self) -> BaseException | None:
        """What stopped the optimizer worker (an update that failed), or None while it runs."""
        return self.worker.error

    @property
    def interrupted(self) -> str | None:
        """Why the blocks are at different steps (an abandoned streaming step, a commit that failed part-way), or
        None when they are at one step."""
        return self._interrupted if self._phase is StepPhase.INTERRUPTED else None

    # ---- the phase -----------------------------------------------------------------------------------------
    def _enter_backward(self) -> None:
        """A backward's first block: a micro-batch of the step in progress, or the step's first."""
        self.check_not_interrupted()
        if self._phase is StepPhase.READY:
            raise refusals.backward_after_last_backward(self.options.accumulation_steps)
        if self._phase is StepPhase.IDLE:  # a step's first backward: nothing of a dropped step's is read now
            self.hypers.forget_read()
        self._set_phase(StepPhase.BACKWARD)

    def _set_phase(self, phase: StepPhase) -> None:
        """The one place the step phase changes (checked against runtime.engine.step_phase's table)."""
        check_phase_transition(self._phase, phase)
        self._phase = phase

    @property
    def phase(self) -> StepPhase:
        """Where the step in progress is."""
        return self._phase

    # ---- closing -------------------------------------------------------------------------------------------
    def _stop_started(self) -> None:
        """A setup that failed past the state's registration: stop the threads ``_start`` got to (each one tried,
        a failure logged: the setup's own error is what offload() raises)."""
        host_sums = getattr(self, "host_sums", None)
        for part in (None if host_sums is None else host_sums.sums, getattr(self, "worker", None),
                     getattr(self, "weights", None)):
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

