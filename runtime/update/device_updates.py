"""The device's share of the update: AdamW on the GPU for the blocks whose master and moments live there
(``optimizer.gpu_update_fraction``) and for the streamed blocks (``optimizer.gpu_stream_fraction``), whose
state is brought in from pinned host memory for the update and written back after it.

A streamed block's state comes in during the backward that ends the step, nearest blocks first (the block
whose backward is about to run, then the ones it reaches next); beyond the first ``always`` of a call, never
into the room weight fetches may need. When
updates wait for the commit (clipping, fp16 loss scaling, the user's own clipping) the state waits on the
device until then, so each copy must fit below what was allocated when that backward began (the memory the
backward freed); otherwise the first two come in at once and the rest under that bound. At the commit the
next blocks' state comes in while each block updates, and the update itself brings its own in on demand if
the budget refused it earlier; afterwards the state is written back ([Note: paced write-back] in
``runtime.engine.writeback``) and the block's compute weights are recast from the updated master on the device.

What it leaves out: which blocks are device-updated or streamed (the engine's placement, handed in and renewed by
``placement_changed``), the gradients (assembled, fp16-unscaled and their norms taken by ``runtime.engine.gradients``;
the clip factors are applied here, at the commit), the write-backs' pacing (``runtime.engine.writeback``) and when
the commit runs (``runtime.engine.commit``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from runtime.core.blocks import Block
from runtime.planning.buffers import DEVICE_MOMENT_PIECE_NUMEL
from runtime.planning.memory_plan import WeightSource, window_bound
from runtime.update.adam import AdamWHyper, scale_slots
from runtime.update.collaborators import ClipFactors, ComputeWeights, WritebackQueue
from runtime.update.moment_kernel import Int8Kernel
from runtime.update.moments import MomentScratch, adamw_update_block, kept_entries
from runtime.update.worker import STATE_KINDS, UpdateWorker
from tierstore import CapacityError, CopyState, TierName, TierStore


@dataclass(frozen=True)
class DeviceUpdateSettings:
    """The session's settings the device updates act on (fixed for the session but the placement, which
    ``DeviceUpdates.placement_changed`` replaces)."""

    weight_source: WeightSource
    prefetch_depth: int  # the weights' prefetch window, kept free of streamed state
    gpu_stream_ahead: int  # streamed blocks whose state may come in ahead of the block in backward
    deferred: bool  # updates wait for the step's commit (clipping, fp16 loss scaling, the user's clip)
    gpu_updated: frozenset[int]  # blocks whose master and moments live on the device
    gpu_streamed: frozenset[int]  # blocks updated on the device over state streamed in from host memory
    moment_dtype: str = "fp32"  # how the moments are stored (runtime.update.moments decodes and encodes them)
    # The compiled int8 kernel the CPU's updates run (optimizer.moment_kernel): used here on the CPU device, where the
    # device updates are CPU updates too; CUDA tensors keep torch ops.
    int8_kernel: Int8Kernel | None = None


class DeviceUpdates:
    """The device-updated and streamed blocks' updates of one step's engine: their pending list (updates that
    wait for the commit), the streamed state's way in, and the update itself. Written against the narrow
    surfaces of ``runtime.update.collaborators`` (``update/`` sits below the engine); writes only the store, the
    weights' device copies, the write-backs and the worker's marks."""

    def __init__(self, settings: DeviceUpdateSettings, blocks: list[Block], store: TierStore, weights: ComputeWeights,
                 worker: UpdateWorker, writebacks: WritebackQueue, clipper: ClipFactors,
                 param_steps: dict[int, list[torch.Tensor]], hypers: Callable[[Block], list[AdamWHyper]]):
        self.settings = settings
        self.gpu_updated = settings.gpu_updated  # this placement's (placement_changed gives the next)
        self.gpu_streamed = settings.gpu_streamed
        self.hypers = hypers  # each of a block's parameters' AdamW hyper-parameters, as the step reads them
        self.blocks = blocks
        self.store = store
        self.device = store.device
        self.weights = weights
        self.worker = worker
        self.writebacks = writebacks  # streamed state on its way home ([Note: paced write-back])
        self.clipper = clipper  # the user's clip factors and dropped gradients, applied at the commit
        self.param_steps = param_steps  # block index -> its parameters' AdamW step counters, on the device
        self.pace_writebacks = True  # False queues each write-back at once (the bench's -nopace rows compare)
        self.pending: list[tuple[Block, torch.Tensor | None, list[bool], int]] = []  # waiting for the commit
        self.stream_ceiling: int | None = None  # device bytes allocated when the streaming backward began
        # Streamed blocks whose new compute weights were cast on the device from the updated master: the next
        # forward uses them as they are (no wait for the write-back, no fetch).
        self.fresh: set[int] = set()
        # GPU-tier bytes that weight fetches may need while streamed state is brought in ahead: the prefetch window.
        self.weights_window_nbytes = self._weights_window()
        # One piece of compact moments in fp32 on the device, reused by every update (allocated at the first).
        self.moment_scratch = MomentScratch(self.device, int8_kernel=settings.int8_kernel)

    def placement_changed(self, gpu_updated: frozenset[int], gpu_streamed: frozenset[int]) -> None:
        """The device's share grew (``runtime.engine.relocation``): fewer weights are fetched."""
        self.gpu_updated, self.gpu_streamed = gpu_updated, gpu_streamed
        self.weights_window_nbytes = self._weights_window()

    def _weights_window(self) -> int:
        """GPU-tier bytes the prefetch window of fetched (not resident) weights may take."""
        if self.settings.weight_source is WeightSource.RESIDENT:
            return 0
        return window_bound([self.weights.nbytes(b.index) for b in self.blocks if b.index not in self.gpu_updated],
                            self.settings.prefetch_depth + 2)

    def submit(self, block: Block, grad: torch.Tensor | None, has_grad: list[bool], step: int) -> None:
        """Block's gradient is final (None: no parameter of it has one): update it now, or at the commit when
        updates wait for it."""
        if self.settings.deferred:
            self.pending.append((block, grad, has_grad, step))
        else:  # without a gradient nothing is updated, and a streamed block's state brought in for it is dropped
            self.update(block, grad, has_grad, step, skip=grad is None)

    def begin_streaming(self) -> None:
        """The backward that ends in an update starts: note the memory in use now, at the end of the forward
        (state streamed ahead may use what the backward frees below it), and, when the state streams during
        the backward, hold resident-weight refreshes until every streamed block's state is on its way (they
        are needed only by the next forward)."""
        device = self.device
        self.stream_ceiling = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        if self.settings.weight_source is WeightSource.RESIDENT and not self.settings.deferred:
            self.weights.hold_refreshes()

    def stream_in_order(self, indices: Iterable[int], always: int = 2) -> None:
        """Bring in the state of these blocks, nearest first: the first ``always`` at once, the rest while memory
        in use stays below the ceiling (see begin_streaming) and the GPU budget keeps room for weight fetches.
        A refusal stops the rest, so a block further ahead never holds room a nearer update needs."""
        streamed = self.gpu_streamed
        for position, index in enumerate(indices):
            if position >= always and not self._room_to_stream(index):
                return
            if not self.stream_in(index):
                return
            if index == min(streamed):
                self.weights.release_refreshes()  # every streamed copy is queued: the refreshes go after them

    def _room_to_stream(self, index: int) -> bool:
        if index not in self.gpu_streamed:
            return True
        block, store = self.blocks[index], self.store
        missing = sum(store.record(block.key(kind)).meta.nbytes for kind in STATE_KINDS
                      if store.state(block.key(kind), TierName.GPU) is CopyState.ABSENT)
        if store.tiers[TierName.GPU].free_nbytes - missing < self.weights_window_nbytes:
            return False
        return self.stream_ceiling is None or torch.cuda.memory_allocated(self.device) + missing <= self.stream_ceiling

    def stream_in(self, index: int, required: bool = False) -> bool:
        """Start copying a streamed block's master and moments to the device (no-op for other blocks and for
        state already there or on its way). A full GPU budget stops an early copy quietly and returns False
        (the update fetches then); with ``required`` (the update itself) it raises.

        The device buffers are allocated on the caller's (compute) stream and the copy waits for the work
        queued there so far: the state takes memory the backward has just freed, and no bytes are parked in
        the copy stream's own allocator pool, which compute can't reuse. (Under a capped GPU memory
        fraction such a side pool makes the allocator release its cache, synchronizing the device.)"""
        if index not in self.gpu_streamed:
            return True
        for kind in STATE_KINDS:
            try:
                self.store.fetch(self.blocks[index].key(kind), TierName.GPU)
            except (CapacityError, torch.OutOfMemoryError):  # an early copy is optional: the update fetches later
                if required:
                    raise
                return False
        return True

    def run(self, coef: torch.Tensor | None, skip: bool) -> None:
        """At the commit: the pending updates, in forward order, each streamed block's state brought in ahead
        of its update, each gradient scaled by its clip factors first."""
        pending = sorted(self.pending, key=lambda item: item[0].index)
        updating = [block.index for block, flat, _, _ in pending if not skip and flat is not None]
        for position, (block, flat, has_grad, step) in enumerate(pending):
            has_grad = self.clipper.kept(block, has_grad)  # p.grad = None after backward drops a parameter
            if not any(has_grad):
                flat = None
            pending[position] = (block, flat, has_grad, step)
        for block, flat, has_grad, step in pending:
            if self.gpu_streamed:  # bring the next blocks' state in while this one updates
                self.writebacks.settle()  # landed write-backs free the memory the next blocks' state comes into
                later = updating[updating.index(block.index):] if block.index in updating else []
                self.stream_in_order(later[: self.settings.gpu_stream_ahead + 1])
            if flat is not None and not skip:
                scale_slots(flat, block, self.clipper.user_scales(block), coef)
            self.update(block, flat, has_grad, step, skip=skip or flat is None)
        self.pending = []

    def update(self, block: Block, grad: torch.Tensor | None, has_grad: list[bool], step: int, skip: bool) -> None:
        """AdamW on the device, stream-ordered on the current stream (the gradient already scaled). A block whose
        state lives there gets its compute weights recast (the next forward needs no host-side wait); a streamed
        block's state is written back to pinned host memory, and the next forward's fetch waits for that copy."""
        store, weights = self.store, self.weights
        streamed = block.index in self.gpu_streamed
        if streamed and (skip or grad is None):
            for kind in STATE_KINDS:  # brought in for nothing: drop the clean device copies
                key = block.key(kind)
                if store.state(key, TierName.GPU) is not CopyState.ABSENT:
                    store.tensor(key, TierName.GPU)  # let a copy in flight land first
                    store.release(key, TierName.GPU)
        if not skip and grad is not None:
            sizes = [slot.numel for slot in block.slots]
            if streamed:
                self.stream_in(block.index, required=True)  # on demand when the budget refused it earlier
            state = {kind: store.tensor(block.key(kind), TierName.GPU) for kind in STATE_KINDS}
            # fp32 moments: today's fused update on per-parameter views; compact ones piece by piece through the scratch.
            adamw_update_block(state["master"], grad, state["exp_avg"], state["exp_avg_sq"], sizes, has_grad,
                               kept_entries(self.param_steps[block.index], has_grad), kept_entries(self.hypers(block), has_grad),
                               self.settings.moment_dtype, scratch=self.moment_scratch, piece_numel=DEVICE_MOMENT_PIECE_NUMEL,
                               rounding_seed=block.index)  # the block's bits wherever it is updated (bf16 rounding)
            if not streamed or self.settings.weight_source is WeightSource.RESIDENT:
                weights.load_resident(block.index, state["master"])  # recast from the device master
            elif weights.fill_from_device(block.index, state["master"]):
                self.fresh.add(block.index)  # the next forward needs it first: no fetch after the write-back
            if streamed:
                for kind in STATE_KINDS:  # written back after the update (the copy waits for this stream)
                    store.mark_dirty(block.key(kind), TierName.GPU, step=step)
                    self.writebacks.add(store.evict(block.key(kind), TierName.GPU, background=self.pace_writebacks))
        self.worker.mark_updated(block.index, step)
