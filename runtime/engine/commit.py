"""The step's commit when updates wait for it (clipping, fp16 loss scaling, the user's clip): decide clip and skip,
then release the updates, each side in forward order, the host's (queued, or resolved where they ran early) before
the device's. Also the spilled blocks' moments read early for those updates during the micro-batches.

A commit that fails before anything is queued drops the step as after ``zero_grad()``; one that fails part-way
leaves the blocks at two steps, and the session refuses until a checkpoint load (``discard`` says which). What it
leaves out: the phase and the step count (the controller moves them), the gradients' way to their update
(``runtime.engine.gradients``) and running the updates (``runtime.update``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from runtime.core.blocks import Block
from runtime.engine.block_state import BlockTable
from runtime.engine.clipping import GradClipper
from runtime.engine.fetch import Fetcher
from runtime.engine.gradients import Gradients
from runtime.engine.held_grads import HeldGrads
from runtime.engine.hypers import StepHypers
from runtime.engine.loss_scale import LossScaler
from runtime.engine.stats import StepStats
from runtime.engine.step_view import StepView
from runtime.engine.torch_calls import GRAD_SET
from runtime.engine.weights import WeightManager
from runtime.engine.writeback import DeviceWritebacks
from runtime.planning.memory_plan import MOMENT_KINDS
from runtime.update.adam import scale_slots
from runtime.update.device_updates import DeviceUpdates
from runtime.update.worker import STATE_KINDS, JobPhase, UpdateJob, UpdateWorker
from tierstore import Handle, TierName, TierStore

log = logging.getLogger(__name__)


class Commit:
    """Turns the pending step's waiting updates into its committed ones."""

    def __init__(self, view: StepView, table: BlockTable, blocks: list[Block], store: TierStore, worker: UpdateWorker,
                 device_updates: DeviceUpdates, clipper: GradClipper, held: HeldGrads, writebacks: DeviceWritebacks,
                 hypers: StepHypers, grads: Gradients, scaler: LossScaler | None, stats: StepStats, weights: WeightManager,
                 fetch: Fetcher):
        self.view = view
        self.table = table
        self.blocks = blocks
        self.store = store
        self.worker = worker
        self.device_updates = device_updates
        self.clipper = clipper
        self.held = held
        self.writebacks = writebacks
        self.hypers = hypers
        self.grads = grads
        self.scaler = scaler
        self.stats = stats
        self.weights = weights
        self.fetch = fetch

    def run(self, discard: Callable[[str | None], None]) -> None:
        """Deferred mode, at the commit: decide clip and skip, then release the updates, each side in forward
        order (the next forward needs the first blocks first; on the host the spilled blocks whose moments were read
        early go before them: ``_commit_order``): the host's, then the device's. ``discard(broken)`` drops the step
        where it fails (``broken``: why the blocks are at different steps, or None)."""
        view, scaler = self.view, self.scaler
        if not view.deferred:
            return
        skip = False
        if scaler is not None:
            skip = bool(self._overflow_anywhere(scaler).item())
        coef = None
        total = self.clipper.commit() if not skip else None
        grad_clip = view.options.grad_clip
        if total is not None and grad_clip is not None:
            coef = torch.clamp(grad_clip / (total + 1e-6), max=1.0)
            self.stats.grad_norms.append(float(total))
        multiplier = None if coef is None else coef.to("cpu")
        try:
            self.hypers.freeze()  # read once, before anything is queued
            scaled = self._send_held_grads(coef, skip)
        except BaseException:
            self.hypers.thaw()
            discard(None)  # nothing was queued: the step is dropped, as after zero_grad()
            raise
        # The CPU's updates are the step's longest tail: its jobs go first, the device's updates after them.
        try:
            scales_host = self._submit_host_jobs(multiplier, skip, scaled)
            self.device_updates.run(coef, skip)
        except BaseException:
            discard(f"the commit of step {view.optimizer_step + 1} failed after some of its updates were queued, so the "
                    "blocks are at different steps. Restore the last checkpoint (runtime.checkpoint.state.load_checkpoint)")
            raise
        finally:
            self.hypers.thaw()
        if not skip:  # hold the next step's host gradients where that saves a multiply: this step's is the guess
            self.grads.hold_grads = self.grads.holds_at_all and scales_host
        elif scaler is not None:
            self.stats.skipped_steps += 1
            log.info("fp16 overflow: step %d skipped, loss scale %.1f -> %.1f", view.optimizer_step + 1,
                     float(scaler.scale), float(scaler.scale) * scaler.backoff_factor)
        if scaler is not None:
            scaler.update()

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
                handle = self.grads.to_host(block, flat)
                scaled[index] = handle
                # Kept alive until seen landed: its memory is in use until then, and the next forward paces itself
                # by it as by the streamed write-backs.
                self.writebacks.add(handle, keep=flat)
            else:
                scaled[index] = None
        return scaled

    def _commit_order(self, index: int) -> tuple[bool, int]:
        """Block index's place in the order the commit queues host updates (and sends held gradients) in: the
        spilled blocks whose moments were read early first (the worker, which prefers them too, may take the first
        job before the next is queued), then forward order."""
        return not self.table[index].read_early, index

    def _submit_host_jobs(self, multiplier: torch.Tensor | None, skip: bool, scaled: dict[int, Handle | None]) -> bool:
        """Queue (or resolve, when they ran early) the host-updated blocks' updates (``_commit_order``), with the
        commit's verdict: clip factors (already applied to the ``scaled`` ones), skip, parameter groups. Returns
        whether any factor was other than 1 (a gradient that did not wait on the device was multiplied)."""
        would_hold, scaled_any = True, False
        # Each job leaves its block's record as it is queued or resolved: a commit that fails part-way leaves the
        # rest to discard_pending (speculative ones resolved there, never twice).
        for job in sorted(self.table.jobs(), key=lambda job: self._commit_order(job.block.index)):
            final = self._final(job, multiplier, skip)
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
            record = self.table[job.block.index]
            record.job = None
            record.read_early = False  # its update uses (and frees) what was read early for it
        for record in self.table:
            record.read_early = False
        if self.view.options.speculate:
            self.stats.speculation_paused += not self.grads.speculate_this_step
            self.grads.speculate_this_step = would_hold
        return scaled_any

    def _final(self, job: UpdateJob, multiplier: torch.Tensor | None, skip: bool) -> UpdateJob:
        """The update the commit decides for a waiting job: its clip factors, skip and the groups as it finds them."""
        scales = self.clipper.user_scales(job.block)
        keep = self.clipper.kept(job.block, job.mask or [True] * len(job.block.slots))
        return dataclasses.replace(
            job, speculative=False, phase=JobPhase.QUEUED, verdict=None, grad_multiplier=multiplier,
            slot_multipliers=None if scales is None else [s if s is None else s.to("cpu") for s in scales],
            hypers=self.hypers.block_hypers(job.block),  # the param_groups as the commit finds them
            mask=None if all(keep) else keep, skip=job.skip or skip or not any(keep))

    # ---- a dropped step ---------------------------------------------------------------------------------------
    def forget_pending(self) -> list[UpdateJob]:
        """Forget the step in progress, no copy and no wait: its waiting jobs (returns the ones running early, for
        ``release_pending``), device updates, held gradients, the blocks' counts and submissions, the clip, the
        gradients of earlier micro-batches still on the device."""
        speculative = [job for job in self.table.jobs() if job.speculative]
        for record in self.table:
            record.job = None
        self.device_updates.pending = []
        self.held.drop()
        self.table.reset_step()
        self.device_updates.fresh.clear()
        self.grads.drop_sums()
        self.clipper.reset()
        with torch._C.DisableTorchFunctionSubclass():  # not through the guard: no host sum to drop, no wait
            for block in self.blocks:
                for slot in block.slots:
                    GRAD_SET(slot.param, None)
        return speculative

    def release_pending(self, speculative: list[UpdateJob], interrupted: bool) -> None:
        """The copies and buffers a dropped step leaves: early results never published, state brought in for it,
        the overflow flag and host sums, moments read early, every fetched block. ``interrupted``: some of its
        updates ran (they finish first; the blocks are then at two steps)."""
        for job in speculative:
            self.worker.resolve(job, False, None)  # its result in the spares is simply never published
        if interrupted:
            # Updates of the dropped step already queued run to the end (the blocks are then at two steps,
            # which the next step refuses); nothing below may race them for the blocks' state (releases, a
            # checkpoint reading a swap file the worker is writing).
            self.worker.drain()
        self.writebacks.wait_all()  # updates of this step already written back stay (the controller refuses)
        for index in self.table.gpu_streamed:  # state brought in for the dropped step: clean copies, let them go
            for kind in STATE_KINDS:
                self.store.release_read_ahead(self.blocks[index].key(kind), TierName.GPU)
        self.clear_overflow_and_sums()
        self.release_read_early()
        for record in self.table:
            record.carried = False
        for state in self.weights.states:
            state.users = 0
        self.weights.drop_gathers()
        self.fetch.release_unused()
        self.weights.release_refreshes()

    def _overflow_anywhere(self, scaler: LossScaler) -> torch.Tensor:
        """The step's fp16 overflow flag, with several processes summed over the ranks first: each rank unscales
        only the gradients of the blocks it owns (reduced there from every rank), so an overflow is seen by one
        owner, and every rank must skip the step and back its loss scale off alike (the scales stay equal, as under
        DDP's GradScaler, whose ranks all see the averaged gradients). One call per commit, every rank at the same
        point ([Note: collectives in program order])."""
        ranks = self.view.options.ranks
        if ranks is not None:
            flag = scaler.found_inf.to(ranks.device, torch.float32)
            ranks.sum(flag)
            scaler.found_inf.copy_(flag)
        return scaler.found_inf

    def clear_overflow_and_sums(self) -> None:
        """Nothing of a dropped step's overflow flag or host sums reaches the next step."""
        if self.scaler is not None:
            self.scaler.found_inf.zero_()
        if self.grads.host.sums is not None:
            self.grads.host.sums.reset()

    # ---- moments read early ------------------------------------------------------------------------------
    def read_spilled_early(self) -> None:
        """Updates that wait for the commit run in forward order, and each spilled block's update first reads its
        moments from NVMe. The moments of this step's updates are fixed since the last commit, so read the first
        spilled blocks' into the host staging room now, while the micro-batches compute: at the commit their updates
        find them in memory. Asked at every backward (a room still held by the last step's write-backs may be free
        by the next); a full room stops it quietly."""
        for index in self.table.spilled_in_update_order:
            staged, accepted = self.worker.stage(self.blocks[index], MOMENT_KINDS)
            self.stats.early_reads += staged
            if staged or accepted:
                self.table[index].read_early = True
            if not accepted:
                return

    def release_read_early(self) -> None:
        """A dropped step: the moments read early for its updates give their room back (they are clean copies)."""
        for index in self.table.read_early():
            for kind in MOMENT_KINDS:
                self.store.release_read_ahead(self.blocks[index].key(kind), TierName.HOST)
            self.table[index].read_early = False


def is_unit(factor: torch.Tensor | None) -> bool:
    """A clip factor that changes no bit: none, or exactly 1 (a CPU tensor)."""
    return factor is None or float(factor) == 1.0


def speculation_holds(speculative: UpdateJob, final: UpdateJob) -> bool:
    """True when the update the commit decided (``final``) is the one a speculative run made: no skip, no clip
    factor but exactly 1 (multiplying by 1 changes no bit), the same parameters and hyper-parameters."""
    all_kept = [True] * len(final.block.slots)
    return (not final.skip and is_unit(final.grad_multiplier) and all(is_unit(s) for s in final.slot_multipliers or [])
            and final.hypers == speculative.hypers and (final.mask or all_kept) == (speculative.mask or all_kept))
