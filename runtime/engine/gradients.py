"""A block's gradient once its backward is done: summed in host memory between micro-batches, or, in the step's last
backward, assembled on the device, unscaled (fp16), its norms taken (clipping), and sent to its update: to host
memory, held on the device until the commit ([Note: held gradients] in ``runtime.engine.held_grads``), or to the
device's own update.

Owns the host sums' slot access that ``p.grad`` serves between micro-batches (``HostSumSlots``), the choice to hold
gradients and to run updates early (speculation), and the zero gradients ``zero_grad(set_to_none=False)`` keeps.
What it leaves out: counting a block's gradients and when a backward ends (the controller's events), the commit's
verdict (``runtime.engine.commit``), and AdamW (``runtime.update``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from runtime.core.blocks import Block
from runtime.core.events import STALL_GRAD_SUM, StallEvent
from runtime.engine.block_state import BlockTable
from runtime.engine.clipping import GradClipper, real_grad
from runtime.engine.held_grads import HeldGrads
from runtime.engine.host_sums import HostGradSums
from runtime.engine.hypers import StepHypers
from runtime.engine.kept_grads import KeptGrads
from runtime.engine.loss_scale import LossScaler
from runtime.engine.stats import StepStats, emit_stall
from runtime.engine.step_phase import StepPhase
from runtime.engine.step_view import StepView
from runtime.engine.torch_calls import GRAD_SET
from runtime.engine.writeback import DeviceWritebacks
from runtime.update.adam import split_views
from runtime.update.device_updates import DeviceUpdates
from runtime.update.worker import STATE_KINDS, UpdateJob, UpdateWorker
from tierstore import Handle, TierName, TierStore

log = logging.getLogger(__name__)


class HostSumSlots:
    """The step's host gradient sums ([Note: host gradient sums]; None: none run, or no longer after a placement
    moved every summed block to the device) and ``p.grad``'s access to one parameter's sum between micro-batches."""

    def __init__(self, view: StepView, blocks: list[Block], store: TierStore, sums: HostGradSums | None):
        self.view = view
        self.blocks = blocks
        self.store = store
        self.sums = sums

    def host_sum_holds(self, slot: tuple[int, int]) -> bool:
        """Between micro-batches: parameter ``slot`` has a gradient summed in host memory this step."""
        return self.sums is not None and self.view.phase is StepPhase.ACCUMULATING and self.sums.has_grad(*slot)

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
        if self.sums is not None and self.view.phase in (StepPhase.ACCUMULATING, StepPhase.READY):
            self.sums.drop(*slot)


class Gradients:
    """Sends each finished block's gradient where its step needs it."""

    def __init__(self, view: StepView, table: BlockTable, blocks: list[Block], store: TierStore, worker: UpdateWorker,
                 device_updates: DeviceUpdates, clipper: GradClipper, held: HeldGrads, kept_grads: KeptGrads,
                 host: HostSumSlots, hypers: StepHypers, scaler: LossScaler | None, writebacks: DeviceWritebacks,
                 stats: StepStats, stall_listeners: list[Callable[[StallEvent], None]]):
        self.view = view
        self.table = table
        self.blocks = blocks
        self.store = store
        self.device = store.device
        self.worker = worker
        self.device_updates = device_updates
        self.clipper = clipper
        self.held = held  # [Note: held gradients]
        self.kept_grads = kept_grads  # zero_grad(set_to_none=False)
        self.host = host  # [Note: host gradient sums]
        self.hypers = hypers
        self.scaler = scaler
        self.writebacks = writebacks
        self.stats = stats
        self.stall_listeners = stall_listeners
        options = view.options
        # Whether this step's host gradients may be held: where a clip (ours or the user's) may scale them.
        self.hold_grads = self.holds_at_all and (options.grad_clip is not None or options.hold_updates)
        # Whether this step's host updates run before its commit (runtime.update.speculation): as long as the last
        # commit kept (or would have kept) every early result. A run whose norm exceeds the clip every step
        # would otherwise redo every early update, and the early runs take the cores and memory bandwidth
        # that the backward's copies and the redo need.
        self.speculate_this_step = True
        self._warned_stale_step = False  # said once: a step() with no backward where plain PyTorch re-applies
        # Several processes: the owner's mean gradient of each block reduced this backward (flat fp32, device), and
        # which parameters any rank had a gradient for; _assemble and _present serve from it ([Note: block ownership]).
        self._reduced: dict[int, tuple[torch.Tensor, list[bool]]] = {}
        # Several processes, micro-batches reduced one by one: the sums so far of the blocks this rank owns and updates
        # on the device, in the compute dtype (their .grad would hold them in one process), with their presence.
        self._device_sums: dict[int, tuple[torch.Tensor, list[bool]]] = {}

    @property
    def holds_at_all(self) -> bool:
        """Whether host gradients are ever held on the device: not where they are narrower than fp32, since the clip's
        product must reach AdamW unrounded (the CPU scales the widened gradient)."""
        return self.view.options.host_grad_dtype == torch.float32

    # ---- a block's backward is done ------------------------------------------------------------------------
    def block_done(self, block: Block, last_micro: bool) -> None:
        """Block's gradients of this backward are complete: the step's last sends them to the update, an earlier
        micro-batch adds them to the host sum (when the block sums there; on the device ``.grad`` accumulates)."""
        sums = self.host.sums
        if self.view.options.ranks is not None:
            if not last_micro and not self._reduced_each_micro_batch():
                return  # .grad accumulates on each rank's device; the step's last backward reduces the sum
            summing_on_device = not last_micro and self.table[block.index].on_device
            if not self._reduce_to_owner(block, summing_on_device):
                if last_micro:
                    self._remote_done(block)
                return
            if summing_on_device:
                return  # added to the owner's sum on its device (_device_sums)
        try:
            if last_micro:
                self.offload(block)
            elif sums is not None and sums.holds(block.index):
                self._send_to_host_sum(block)
        finally:
            self._reduced.pop(block.index, None)

    def _reduce_to_owner(self, block: Block, keep_summing: bool = False) -> bool:
        """Several processes: reduce the block's gradient of this backward onto its owner (the mean over ranks, in
        fp32, with each parameter's presence on any rank), taking it off the parameters. Returns whether this rank
        owns the block; there its mean gradient (plus what earlier micro-batches summed on the device) waits in
        ``_reduced`` for the rest of ``block_done``, or, ``keep_summing`` (a micro-batch before the step's last, of a
        block updated on the device), is added to that sum. Every rank calls it for the same blocks in the same order
        ([Note: collectives in program order])."""
        ranks, owner = self.view.options.ranks, self.view.options.owners[block.index]
        assert ranks is not None
        present = [slot.param.grad is not None for slot in block.slots]
        numel = block.numel
        # The presence flags travel in the same call, past the gradient: a parameter another rank's batch reached
        # has a gradient on the owner (zeros from the ranks it did not reach), as DDP's averaged .grad.
        flat = torch.empty(numel + len(block.slots), dtype=torch.float32, device=self.device)
        flat[:numel] = self._assemble(block, present)
        flat[numel:] = torch.tensor(present, dtype=torch.float32)
        ranks.reduce_mean(flat, owner)
        if owner != ranks.rank:
            return False
        # Any rank's gradient makes a parameter present: where this rank has every one, so has the mean, and the
        # flags are not read back (a read waits for the GPU: the backward's next kernels would be launched only then)
        grad, present = flat[:numel], (present if all(present) else (flat[numel:] > 0).tolist())
        earlier = self._device_sums.pop(block.index, None)
        if earlier is not None:  # the step's earlier micro-batches, summed in the compute dtype as .grad would be
            grad = grad.to(earlier[0].dtype).add_(earlier[0]).float()
            present = [a or b for a, b in zip(present, earlier[1], strict=True)]
        if keep_summing:
            self._device_sums[block.index] = (grad.to(self.view.options.compute_dtype), present)
        else:
            self._reduced[block.index] = (grad, present)
        return True

    def _reduced_each_micro_batch(self) -> bool:
        """Several processes whose micro-batches' gradients are summed on the host ([Note: host gradient sums]): then
        every block's gradient is reduced onto its owner as each micro-batch's backward is done, so that no rank holds
        the whole model's gradients between micro-batches (they would not fit beside the rest; the owner sums its
        blocks', on the host or, for a block updated on the device, there). Otherwise .grad accumulates on every
        rank and the step's last backward reduces it. Decided from the config alone, so every rank decides alike."""
        options = self.view.options
        return options.host_sums and options.accumulation_steps > 1

    def drop_sums(self) -> None:
        """A dropped step: the gradients reduced or summed on the device for it go."""
        self._reduced.clear()
        self._device_sums.clear()

    def _remote_done(self, block: Block) -> None:
        """The step's last backward of a block another rank owns and updates: no state here to update, but the
        step's bookkeeping as for any block (a skip job marks it updated, so the next forward's wait passes at once;
        its weights come by broadcast)."""
        self.table[block.index].updating = True
        job = UpdateJob(block, None, self.view.optimizer_step + 1, self.hypers.block_hypers(block), skip=True)
        if self.view.deferred:
            self.table[block.index].job = job
        else:
            self.worker.submit(job)

    def _present(self, block: Block) -> list[bool]:
        """Which of the block's parameters have a gradient of this backward (over every rank, where several run)."""
        reduced = self._reduced.get(block.index)
        return list(reduced[1]) if reduced is not None else [slot.param.grad is not None for slot in block.slots]

    def _assemble(self, block: Block, present: list[bool], begin: int = 0, end: int | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Elements ``[begin, end)`` (default: all) of the block's flat gradient, as a new device tensor of ``dtype``
        (zeros for parameters not ``present``), taken off the parameters: a parameter's ``.grad`` is dropped once its
        last element is in."""
        end = block.numel if end is None else end
        reduced = self._reduced.get(block.index)
        if reduced is not None:  # several processes: the mean over ranks, reduced onto this owner
            return reduced[0][begin:end].to(dtype, copy=True)
        flat = torch.empty(end - begin, dtype=dtype, device=self.device)
        with torch.no_grad():
            for slot, has in zip(block.slots, present, strict=False):
                low, high = max(begin, slot.offset), min(end, slot.offset + slot.numel)
                if low < high:
                    view = flat[low - begin : high - begin]
                    if has:
                        view.copy_(cast(torch.Tensor, slot.param.grad).reshape(-1)[low - slot.offset : high - slot.offset])
                    else:
                        view.zero_()
                if slot.offset + slot.numel <= end:  # all of it is in (or was, in an earlier piece)
                    take_grad(slot.param)
        return flat

    def _send_to_host_sum(self, block: Block) -> None:
        """A micro-batch that does not end the step: the block's gradient, in the host gradient dtype, joins its host
        sum a piece at a time (the GPU holds the pieces in flight, not a second copy of the block's gradient)."""
        present = self._present(block)
        if not any(present):
            return
        self.worker.wait_updated(block.index, self.view.optimizer_step)  # [Note: the gradient buffer waits]
        start = time.perf_counter()
        sums = self.host.sums
        assert sums is not None
        try:
            waited = sums.add_pieces(block, lambda begin, end: self._assemble(block, present, begin, end, sums.dtype), present)
        finally:  # a piece that failed: the gradients go all the same, as after a whole one
            for slot in block.slots:
                take_grad(slot.param)
        if waited > 0.0 and self.stall_listeners:
            emit_stall(self.stall_listeners, block.index, STALL_GRAD_SUM, waited, self.view.optimizer_step, start)

    def offload(self, block: Block) -> None:
        """Assemble the block's gradient on the device (fp32, or the host gradient dtype for a host-updated block;
        adding the host sum of the step's earlier micro-batches when there is one), check / unscale / take fp32
        norms, copy it to host (or hold it on the device until the commit: [Note: held gradients] in
        runtime.engine.held_grads)."""
        view, record, sums = self.view, self.table[block.index], self.host.sums
        deferred = view.deferred
        present = self._present(block)
        if not deferred:  # streaming: the step's updates take the groups as now
            self.hypers.note_streaming_read()
        earlier = sums.finish(block.index) if sums is not None and sums.holds(block.index) else None
        record.updating = True  # its master is about to change: no prefetch until the step commits
        has_grad = present if earlier is None else [a or b for a, b in zip(present, earlier, strict=False)]
        has_grad = self.kept_grads.merge(block.index, has_grad)  # zeros where zero_grad(set_to_none=False) kept them
        step = view.optimizer_step + 1
        on_device = record.on_device
        if not on_device:
            # [Note: the gradient buffer waits] The last committed update of the block reads its host gradient
            # buffer, which this step's gradient (or host sum) is about to fill. A forward's fetch of the block
            # waited for that update already; a block no forward used did not (a zero gradient kept by
            # zero_grad(set_to_none=False), a gradient assigned by hand, a step() with no backward).
            self.worker.wait_updated(block.index, view.optimizer_step)
        if not any(has_grad) and on_device:
            self.device_updates.submit(block, None, has_grad, step)
            return
        if not any(has_grad):
            job = UpdateJob(block, None, step, self.hypers.block_hypers(block), skip=True)
        else:
            # Parameters without any gradient: excluded below. A host gradient narrower than fp32 is the gradient
            # as backward computed it (nothing is rounded), or the plain loop's sum of it (_add_host_sum).
            flat = self._assemble(block, present, dtype=torch.float32 if on_device else view.options.host_grad_dtype)
            with torch.no_grad():
                if earlier is not None:  # g_last + sum: addition commutes, so the plain loop's bits in its dtype
                    self._add_host_sum(block, flat)
                views = [v for v, kept in zip(split_views(flat, [s.numel for s in block.slots]), has_grad, strict=False)
                         if kept]
                if self.scaler is not None:
                    torch._amp_foreach_non_finite_check_and_unscale_(views, self.scaler.found_inf, self.scaler.inv_scale())
                # Updates that wait for the commit keep each gradient's norm: clipping (ours or the user's).
                self.clipper.record(block, has_grad, fp32_norms(views) if deferred else None)
            if on_device:
                self.device_updates.submit(block, flat, has_grad, step)
                return
            job = UpdateJob(block, None, step, self.hypers.block_hypers(block), mask=None if all(has_grad) else has_grad)
            job.speculative = deferred and self._speculates(block)
            held = deferred and not job.speculative and self.hold_grads and self.held.try_hold(block.index, flat)
            if not held:
                job.grad_handle = self.to_host(block, flat)
        if not deferred:
            self.worker.submit(job)
            return
        record.job = job
        if job.speculative:  # runs now, out of place; the commit publishes or redoes it
            self.stats.early_updates += 1
            self.worker.submit(job)

    def _add_host_sum(self, block: Block, flat: torch.Tensor) -> None:
        """Add the block's host gradient sum into its flat gradient on the device (the same dtype), brought in a piece
        at a time (``sums.piece_numel``): the GPU holds one piece beside the gradient, not a second copy of it."""
        summed = self.store.tensor(block.key("grad"), TierName.HOST)
        assert self.host.sums is not None
        step = self.host.sums.piece_numel
        for begin in range(0, block.numel, step):
            end = min(block.numel, begin + step)
            flat[begin:end].add_(summed[begin:end].to(self.device, non_blocking=True))

    def _speculates(self, block: Block) -> bool:
        """Deferred mode: block's host update runs before the commit this step (runtime.update.speculation)."""
        return self.view.options.speculate and self.speculate_this_step and self.worker.spares.can_speculate(block)

    def to_host(self, block: Block, flat: torch.Tensor) -> Handle:
        """Copy block's gradient into its host buffer (ordered after the work that produced it)."""
        return self.store.engine.d2h(block.key("grad"), flat, self.store.tensor(block.key("grad"), TierName.HOST))

    # ---- the step's last backward ----------------------------------------------------------------------------
    def forward_begin(self) -> None:
        """A training forward begins (deferred mode): the held gradients' room is what the copies in flight leave."""
        self.held.forward_begin(self._copies_in_flight_nbytes)

    def _copies_in_flight_nbytes(self) -> int:
        """Device bytes still held by copies to host that nobody has seen land (write-backs, held gradients)."""
        self.writebacks.settle()
        return self.writebacks.held_nbytes()

    def begin_last_backward(self) -> None:
        """The backward that ends the step begins (or a short step ends early): the room held gradients may take is
        measured now, and the streamed blocks' state starts to come in."""
        if self.view.deferred:
            self.held.begin(self._streamed_state_nbytes())
        if self.table.gpu_streamed:
            self.device_updates.begin_streaming()

    def _streamed_state_nbytes(self) -> int:
        """Device bytes of every streamed block's master and moments ([Note: held gradients])."""
        return sum(self.store.record(self.blocks[i].key(kind)).meta.nbytes for i in self.table.gpu_streamed
                   for kind in STATE_KINDS)

    def stream_state_ahead_of(self, index: int) -> None:
        """Backward runs in descending block order: block index's streamed state, then that of the ones it reaches
        next. When the updates wait for the commit (clipping, fp16) the state waits on the device too, so every copy
        must fit the memory the backward freed; at the commit only the update itself is left."""
        ahead = range(index, max(index - 1 - self.view.options.gpu_stream_ahead, -1), -1)
        self.device_updates.stream_in_order(ahead, always=0 if self.view.deferred else 2)

    def take_all(self) -> None:
        """End the step as its last micro-batch's backward would: every block's gradient so far is taken off now,
        in backward order, with the same calls a backward makes."""
        for index in range(len(self.blocks) - 1, -1, -1):
            if self.table.gpu_streamed:
                self.writebacks.settle()
                self.stream_state_ahead_of(index)
            self.block_done(self.blocks[index], last_micro=True)

    # ---- what plain PyTorch's .grad would hold -----------------------------------------------------------------
    def note_zero_grad(self, set_to_none: bool) -> None:
        """``optimizer.zero_grad(set_to_none)`` is about to drop the gradients (before the pending step is discarded):
        with zeros kept, the parameters holding a gradient of the step in progress (on the device, or summed in host
        memory) keep a zeroed ``.grad`` in plain PyTorch, which the next step updates (``runtime.engine.kept_grads``)."""
        sums, pending = self.host.sums, self.view.phase.pending
        present = [] if set_to_none else [
            (index, position) for index, block in enumerate(self.blocks) for position, slot in enumerate(block.slots)
            if real_grad(slot.param) is not None or (sums is not None and pending and sums.has_grad(index, position))]
        self.kept_grads.zero_grad(set_to_none, present)

    def has_assigned(self) -> bool:
        """Between steps, whether some offloaded parameter holds a real ``.grad``: one assigned by hand, since a
        backward's gradients leave the parameters for their update and a dropped step clears them."""
        return any(real_grad(slot.param) is not None for block in self.blocks for slot in block.slots)

    def warn_if_last_held(self, what: str) -> None:
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


def fp32_norms(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's 2-norm computed and returned in fp32, whatever the gradients' dtype: the plain loop takes
    them from its fp32 masters' gradients, which hold the same values in fp32."""
    if views and views[0].dtype != torch.float32:
        return list(torch._foreach_norm(views, 2.0, dtype=torch.float32))
    return list(torch._foreach_norm(views, 2.0))


def take_grad(param: nn.Parameter) -> None:
    """Take a gradient off its parameter for the step: not through the parameter guard, which would take it for the
    user dropping it (``GradClipper.on_grad_set``: plain PyTorch would then hold no ``.grad`` tensor for it)."""
    with torch._C.DisableTorchFunctionSubclass():
        GRAD_SET(param, None)
