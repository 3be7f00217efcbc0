"""One record per block: where its state lives and where it is in the step in progress.

The engine's parts (fetch, gradients, commit, relocation) read and write these records instead of keeping
index-keyed sets of their own: a block's update site (host, device, streamed) and spill, whether a backward holds
its weights, how many of its gradients this backward finished, whether its update of the pending step was
submitted, and the job waiting for the commit. Pure bookkeeping: no tensors, no locks (a flag the optimizer
worker sets, ``wanted`` / ``capacity_refused``, is one attribute store, atomic under the GIL as ``set.add`` was).

What it leaves out, as each is another component's own state kept under its own lock or with its own buffers:
the compute weights' residency and users (``runtime.engine.weights.BlockWeights``), the step a block's master
holds (``UpdateWorker.updated_step``, under the worker's condition), the gradients held on the device
(``held_grads``), summed in host memory (``host_sums``) or kept as zeros per parameter (``kept_grads``), and the
device updates' pending list and fresh weights (``runtime.update.device_updates``, below the engine).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

from runtime.core.blocks import Block
from runtime.update.worker import UpdateJob


class UpdateSite(enum.Enum):
    """Where a block's AdamW runs, which says where its master and moments live and where its gradient goes."""

    HOST = "host"  # the CPU worker, over state in host memory or on NVMe; the gradient goes to host memory
    DEVICE = "device"  # the device, over state that lives there (optimizer.gpu_update_fraction)
    STREAMED = "streamed"  # the device, over state streamed in from host memory for the update (gpu_stream_fraction)


@dataclass(slots=True, eq=False)
class BlockState:
    """One block's place in the placement and in the step in progress."""

    block: Block
    num_slots: int  # parameters of the block: a backward has finished it once that many gradients are in
    site: UpdateSite = UpdateSite.HOST
    spilled: bool = False  # its moments live on NVMe although the homes say host memory
    remote: bool = False  # another rank owns its state ([Note: block ownership]): this one keeps none of it
    # ---- the step in progress (reset when it commits or is dropped) ----
    grads_done: int = 0  # parameters whose gradient this backward finished
    in_backward: bool = False  # weights held for a backward (or a recomputation) until its gradients are done
    in_grad_only: bool = False  # weights held by a backward that is no micro-batch (on_grad_only_backward)
    updating: bool = False  # its update of the pending step was submitted: no prefetch until the commit
    job: UpdateJob | None = None  # its host update, waiting for the commit (deferred mode)
    read_early: bool = False  # its spilled moments were read for this step's update during the micro-batches
    # ---- the forward's side ----
    wanted: bool = False  # the forward wants it but its update had not landed: fetched the moment it lands
    carried: bool = False  # a backward left it on the device for the next micro-batch's forward
    capacity_refused: bool = False  # the GPU budget refused its prefetch (kept only with stall listeners)

    @property
    def index(self) -> int:
        """The block's position in forward order."""
        return self.block.index

    @property
    def on_device(self) -> bool:
        """Its update runs on the device (its gradient never leaves it)."""
        return self.site is not UpdateSite.HOST


class BlockTable:
    """Every block's record, in forward order, and the placement's sets derived from them (kept in step with the
    records: the placement changes only through ``place``)."""

    def __init__(self, blocks: list[Block], gpu_updated: frozenset[int], gpu_streamed: frozenset[int],
                 spilled: frozenset[int], remote: frozenset[int] = frozenset()):
        self.states = [BlockState(block, len(block.slots), remote=block.index in remote) for block in blocks]
        self.remote = remote
        self.gpu_updated: frozenset[int] = frozenset()
        self.gpu_streamed: frozenset[int] = frozenset()
        self.spilled_in_update_order: list[int] = []
        self.place(gpu_updated, gpu_streamed, spilled)

    def __getitem__(self, index: int) -> BlockState:
        return self.states[index]

    def __iter__(self) -> Iterator[BlockState]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def place(self, gpu_updated: frozenset[int], gpu_streamed: frozenset[int], spilled: frozenset[int]) -> None:
        """Set each block's update site and spill (at setup, and when a placement is adopted)."""
        for state in self.states:
            index = state.index
            state.site = UpdateSite.DEVICE if index in gpu_updated else \
                UpdateSite.STREAMED if index in gpu_streamed else UpdateSite.HOST
            state.spilled = index in spilled
        self.gpu_updated, self.gpu_streamed = gpu_updated, gpu_streamed
        self.spilled_in_update_order = sorted(spilled)

    def host_updated(self) -> list[Block]:
        """The blocks whose update runs on this process's CPU."""
        return [state.block for state in self.states if state.site is UpdateSite.HOST and not state.remote]

    def updating(self) -> list[int]:
        """Blocks whose update of the pending step was submitted, in forward order."""
        return [state.index for state in self.states if state.updating]

    def read_early(self) -> list[int]:
        """Blocks whose spilled moments this step read early, in forward order."""
        return [state.index for state in self.states if state.read_early]

    def jobs(self) -> list[UpdateJob]:
        """Host updates waiting for the commit, in forward order."""
        return [state.job for state in self.states if state.job is not None]

    def end_backward(self) -> None:
        """A backward's end: no block is held by it, and the next one counts gradients afresh."""
        for state in self.states:
            state.grads_done = 0
            state.in_backward = False

    def reset_step(self) -> None:
        """Forget the step in progress (committed elsewhere, or dropped): counts, holds, submissions."""
        for state in self.states:
            state.grads_done = 0
            state.in_backward = False
            state.updating = False
