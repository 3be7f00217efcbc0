"""The weights' side of a pass: acquire a block for a forward or backward (wait for its update and its weights),
prefetch the next ones, release what no pass needs, and say why a wait stalled.

Reads the step through a ``StepView``, each block's place in it through its record (``runtime.engine.block_state``),
and acts on the weights (``runtime.engine.weights``), the schedule and the worker's marks. What it leaves out: when a
pass begins or ends (the controller's events), gradients (``runtime.engine.gradients``) and the write-backs' pacing
itself (``runtime.engine.writeback``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from runtime.core.blocks import Block
from runtime.core.events import STALL_CAPACITY, STALL_FETCH_HOST, STALL_FETCH_NVME, STALL_UPDATE, StallEvent
from runtime.engine.block_state import BlockTable, UpdateSite
from runtime.engine.schedule import PrefetchSchedule
from runtime.engine.stats import StepStats, emit_stall
from runtime.engine.step_phase import StepPhase
from runtime.engine.step_view import StepView
from runtime.engine.weights import WeightManager
from runtime.engine.writeback import DeviceWritebacks
from runtime.planning.memory_plan import WeightSource
from runtime.update.worker import UpdateWorker
from tierstore import CapacityError, TierName, TierStore


class Fetcher:
    """Acquires, prefetches and releases blocks' compute weights for the passes of one model."""

    def __init__(self, view: StepView, table: BlockTable, blocks: list[Block], store: TierStore, weights: WeightManager,
                 schedule: PrefetchSchedule, worker: UpdateWorker, writebacks: DeviceWritebacks, stats: StepStats,
                 stall_listeners: list[Callable[[StallEvent], None]]):
        self.view = view
        self.table = table
        self.blocks = blocks
        self.store = store
        self.weights = weights
        self.schedule = schedule
        self.worker = worker
        self.writebacks = writebacks
        self.stats = stats
        self.stall_listeners = stall_listeners  # the controller's list: the profiler appends to it
        # Layer blocks acquired by a forward recomputed inside a backward (activation checkpointing: the model's own
        # where its hooks see it, or runtime.model.recompute's), counted over the session. A head or a loss recomputed by
        # the model does not count: its layers may still be worth recomputing.
        self.recomputed_acquires = 0
        # Blocks a training forward left on the device for backward -> bytes, oldest first: a byte budget's queue
        # (its order is the point), not a fact of each block, so it is not in the blocks' records.
        self._kept: dict[int, int] = {}
        # A block whose forward just ended without releasing it, the trace expecting it next (a head called once per
        # loss piece): held for that next acquire only ([Note: held blocks are not broadcast again]).
        self._kept_for_next: int | None = None
        self.kept_for_next_hits = 0  # acquires that found their block so held (counted over the session)

    # ---- acquire / release -----------------------------------------------------------------------------
    def acquire(self, indices: list[int], phase: str) -> None:
        """Blocks are about to be used: record the use, wait for their update and weights, prefetch ahead."""
        self.store.engine.poll()
        if phase == "fwd" and self.paces_forward and indices and torch.is_grad_enabled():
            self.writebacks.before_forward(indices[0])
        for index in indices:
            self.schedule.observe(index, phase)
            self.ready(index, held=self.held(index))
            if phase == "recompute":
                self.recomputed_acquires += self.blocks[index].is_layer
                # Activation checkpointing may stop a recomputation early (its forward hook never runs):
                # the weights are held until the block's gradients are done instead of by a user count.
                self.table[index].in_backward = True
            else:
                self.weights.states[index].users += 1
        self.prefetch()
        if self.view.options.ranks is not None:
            self._gather_next(indices)

    def _gather_next(self, acquired: list[int]) -> None:
        """Several processes: start the broadcast of the block the trace expects next, so that it overlaps the
        compute of the blocks just acquired ([Note: collectives in program order]: the trace is the same on every
        rank). Not a block in use now (its weights are on every device already), and only once its update of the
        committed step has landed (the owner's weights are then current)."""
        upcoming = self.schedule.next_use()
        if upcoming is None or upcoming in acquired:
            return
        if self.weights.states[upcoming].users > 0 or self.table[upcoming].in_backward:
            return
        self.worker.wait_updated(upcoming, self.view.optimizer_step)
        self.weights.gather_ahead(upcoming)

    def release_after_forward(self, indices: list[int], phase: str) -> None:
        """A module's forward ended: drop the weights unless the schedule needs them again soon."""
        if phase == "recompute":
            return  # held until the block's gradients are done (see acquire)
        depth = self.view.options.prefetch_depth
        for index in indices:
            state = self.weights.states[index]
            state.users -= 1
            if state.users == 0 and not self.table[index].in_backward and not self.schedule.needed_within(index, depth + 1):
                if not self._keep_for_backward(index):
                    self.release(index)
            elif state.users == 0 and not self.table[index].in_backward and self.schedule.next_use() == index:
                # Needed next (not released): held for that acquire, out of the keep-for-backward queue, whose
                # evictions differ by rank (a block updated on the device is never kept)
                self._kept.pop(index, None)
                self._kept_for_next = index

    def _keep_for_backward(self, index: int) -> bool:
        """Leave a block's weights on the device for the backward of this training forward, within
        prefetch.keep_for_backward bytes: the newest blocks stay (backward needs them first); older kept
        ones are released to make room."""
        options = self.view.options
        budget = options.keep_for_backward_nbytes
        if not budget or not torch.is_grad_enabled() or self.table[index].site is UpdateSite.DEVICE \
                or options.weight_source is WeightSource.RESIDENT:
            return False
        nbytes = self.weights.nbytes(index)
        if nbytes > budget:
            return False
        self._kept[index] = nbytes
        while sum(self._kept.values()) > budget:
            oldest = next(iter(self._kept))
            self.release(oldest)
        return True

    def release(self, index: int) -> None:
        """Free block index's fetched compute weights (no-op when in use or always resident)."""
        self._kept.pop(index, None)
        self.weights.release(index)

    def release_unused(self, keep: Callable[[int], bool] = lambda index: False) -> None:
        """Release every block no module holds now, but those ``keep`` names."""
        for index, state in enumerate(self.weights.states):
            if state.users == 0 and not keep(index):
                self.release(index)

    def sweep_leftovers(self, fresh: set[int]) -> None:
        """A forward begins: the last backward's carried blocks stay when this forward begins with them, and so do
        ``fresh`` ones (a device update's new weights); any other leftover (prefetched for a path not taken, or after
        anything that may have changed the weights) goes."""
        self.drop_kept_for_next()
        upcoming = set(self.schedule.upcoming(self.wrap_limit))
        for index, state in enumerate(self.weights.states):
            record = self.table[index]
            carried = record.carried and index in upcoming
            record.carried = False
            record.in_grad_only = False  # a gradient-only backward that raised: its blocks go in this sweep
            if state.users == 0 and not record.in_backward and index not in fresh and not carried:
                self.release(index)

    def release_grad_only(self, fresh: set[int]) -> None:
        """A gradient-only backward ended: the blocks it held go, unless something else holds them (a training
        backward it ran inside, a forward) or the next forward wants them (carried, or ``fresh`` device-cast weights)."""
        for record in self.table:
            if not record.in_grad_only:
                continue
            record.in_grad_only = False
            index = record.index
            if self.weights.states[index].users == 0 and not record.in_backward \
                    and not record.carried and index not in fresh:
                self.release(index)

    def drop_raised_forward_holds(self) -> bool:
        """Outside a forward: blocks a forward that raised left held (their users counted, never released) are
        released. Returns whether there were any."""
        self.drop_kept_for_next()
        raised = False
        for index, state in enumerate(self.weights.states):
            if state.users:  # a forward raised inside this block: nothing else holds it
                state.users = 0
                self.release(index)
                raised = True
        return raised

    # ---- waiting -----------------------------------------------------------------------------------------
    def held(self, index: int) -> bool:
        """Whether block index is held since an earlier acquire: a forward still inside it (``users``), a backward
        that still needs it (``in_backward``: its recomputation acquires it again), or a forward of it that ended
        just before without releasing it, the trace expecting it next. Called once per acquire, before the acquire
        marks the block: the last kind holds for this one acquire (``drop_kept_for_next``). The hooks and the trace
        alone set these marks, in the same order on every rank: with several processes a held block's weights are on
        every device since the acquire that broadcast them ([Note: held blocks are not broadcast again])."""
        kept_for_next = self._kept_for_next
        self.drop_kept_for_next()
        if self.weights.states[index].users > 0 or self.table[index].in_backward:
            return True
        self.kept_for_next_hits += index == kept_for_next
        return index == kept_for_next

    def is_kept_for_next(self, index: int) -> bool:
        """Whether block index is held for the next acquire (``held``): a read between passes must not release it."""
        return index == self._kept_for_next

    def drop_kept_for_next(self) -> None:
        """The hold for the next acquire ends: at that acquire, and at every point where the ranks' paths meet before
        anything may release or change a block (a forward begins, a step commits or is dropped, a forward that raised
        is cleaned up), so no rank finds it released while another finds it held. The block is not released here."""
        self._kept_for_next = None

    def ready(self, index: int, held: bool = False) -> None:
        """Wait for block index's update of the committed step, then for its weights on the device. ``held``: the
        block was held by an earlier acquire since (``held()``, read before this acquire marks it)."""
        step = self.view.optimizer_step
        if not self.worker.is_updated(index, step):
            self.table[index].wanted = True  # the worker fetches it the moment its update lands
        waited = self.worker.wait_updated(index, step)
        self.stats.wait_update_s += waited
        if waited > 0.0 and self.stall_listeners:
            emit_stall(self.stall_listeners, index, STALL_UPDATE, waited, step, time.perf_counter() - waited)
        if self.view.options.weight_source is WeightSource.RESIDENT:
            self.weights.wait_refresh(index)
            self.schedule.record_fetch(True)
            return
        # Only a block not fetched yet can miss; its cause is read before the on-demand fetch stages it.
        # (a block another rank owns comes by broadcast, not by a fetch of ours: its wait has no fetch cause)
        cause = self._fetch_stall_cause(index) if self.stall_listeners and not self.weights.is_fetched(index) \
            and not self.weights.is_remote(index) else None
        t1 = time.perf_counter()
        hit = self.weights.wait(index, held)
        waited = time.perf_counter() - t1 if not hit else 0.0
        self.stats.wait_fetch_s += waited
        if not hit and cause is not None:
            emit_stall(self.stall_listeners, index, cause, waited, step, t1)
        self.schedule.record_fetch(hit)

    def _fetch_stall_cause(self, index: int) -> str:
        """Why an on-demand fetch of block index would wait: a refused prefetch, NVMe staging, or a plain miss."""
        record = self.table[index]
        if record.capacity_refused:
            record.capacity_refused = False
            return STALL_CAPACITY
        key = self.weights.source_key(self.blocks[index])
        if self.store.record(key).home is TierName.NVME and not self.store.state(key, TierName.HOST).is_current:
            return STALL_FETCH_NVME
        return STALL_FETCH_HOST

    @property
    def paces_forward(self) -> bool:
        """Copies off the device may be in flight when a training forward starts (streamed state written back,
        held gradients sent at the commit): the forward waits for them where a block would not fit
        ([Note: paced write-back])."""
        return bool(self.table.gpu_streamed) or self.view.deferred

    # ---- prefetch ----------------------------------------------------------------------------------------
    @property
    def wrap_limit(self) -> int:
        """[Note: prefetch across micro-batches] The backward of a micro-batch that does not end the step fetches
        the next forward's first blocks once its own remaining blocks are fewer than the depth, and keeps its last
        ones (the forward's first): the forward is bound by the weights' copies (it computes a block faster than its
        fp32 master crosses PCIe), the copy engine idles at the backward's end, and without this the forward began by
        fetching again what the backward had just released. Up to depth + 1 blocks in all, the block in use among
        them: within the window the plan counts (depth + 2). In the usual order a block's gradients are done before
        the next block's backward begins, so the backward keeps the forward's first ``depth`` fetched blocks and
        fetches one more (``runtime.bench.train_bound`` counts ``depth``). The carried blocks are named at the
        backward's end (``BlockState.carried``) and only they survive the next forward's sweep of leftovers. No master
        changes between these micro-batches: updates start in the step's last backward, which wraps nothing, and
        ``step()`` releases every block it updates; ``discard_pending`` releases everything; state writes and
        checkpoint loads are refused while a step is pending."""
        return self.view.options.prefetch_depth + 1

    def wraps(self) -> bool:
        """Whether the micro-batch in progress is followed by another of this step (see wrap_limit)."""
        return self.view.phase is StepPhase.BACKWARD and not self.view.last_micro

    def upcoming(self) -> list[int]:
        """The blocks to have on the device next: the schedule's, past this pass into the next where it wraps."""
        return self.schedule.upcoming(wrap_limit=self.wrap_limit if self.wraps() else 0)

    def kept_for_next_forward(self, index: int) -> bool:
        """The block's weights stay for the next micro-batch's forward, which needs them among its first blocks
        ([Note: prefetch across micro-batches])."""
        return self.wraps() and index in self.upcoming()

    def carry_to_next_forward(self) -> None:
        """A backward's end: where the micro-batch wraps, name what the next forward finds on the device."""
        if not self.wraps():
            return
        for record in self.table:
            record.carried = False
        for index in self.upcoming():
            if self.weights.is_fetched(index):
                self.table[index].carried = True

    def prefetch(self) -> None:
        """Issue the fetches of the upcoming blocks whose update has landed, within the GPU budget."""
        if self.view.options.weight_source is WeightSource.RESIDENT:
            return
        table, step = self.table, self.view.optimizer_step
        for index in self.upcoming():
            if self.weights.is_fetched(index) or table[index].updating:
                continue
            if not self.worker.is_updated(index, step):
                table[index].wanted = True
                continue
            try:
                self.weights.fetch(index, prefetch=True)
            except CapacityError:
                if self.stall_listeners:
                    table[index].capacity_refused = True
                return  # the GPU budget is full: fetch on demand later

    def on_block_updated(self, index: int) -> None:
        """Worker thread: block index's update just landed; fetch it now if the forward is waiting for it."""
        record = self.table[index]
        if not record.wanted or self.view.options.weight_source is WeightSource.RESIDENT:
            return
        record.wanted = False
        try:
            self.weights.fetch(index, prefetch=True)
        except CapacityError:
            if self.stall_listeners:
                record.capacity_refused = True  # one attribute store, atomic: safe from the worker thread
            # the GPU budget is full: the forward fetches on demand
