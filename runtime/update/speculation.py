"""Second host buffers for updates that run before their step commits.

[Note: speculative updates]
When an update must wait for the whole gradient (global-norm clipping, fp16 overflow checks, a clip in the
user's loop), its CPU AdamW would otherwise start only when backward ends and ``optimizer.step()`` commits.
Instead, each host-updated block's update runs as soon as its gradient lands, *out of place*: the new master
and moments are written to this module's spare buffers while the store's copies keep the values from before
the step (``runtime.update.adam.adamw_update_out_of_place``: the same bytes move as in place, plus one read). At the
commit the controller compares what the speculative run assumed (no clip factor, the parameter groups and the
gradient mask as they were when it was queued) with what the commit decided:

- the same (most steps: coefficient exactly 1, no overflow): the spare buffers become the store's copies by a
  pointer exchange (``TierStore.exchange_host``), the compute weights are refreshed, the block is updated;
- different (a clip below 1, a user's scale, an overflow, changed hyper-parameters): the spare's result is
  dropped and the ordinary update runs from the untouched state with the commit's values;
- the step is discarded (an exception, ``zero_grad()`` before ``step()``): nothing to undo.

So the result is bit-identical to the deferred update in every case, reads between backward and ``step()``
see the pre-step state (the store's copies never hold a speculative value), and a step that clips costs what
it cost before. Blocks whose state lives on NVMe are not speculated (their staging copy is written back as
it is updated). A block gets spares only when the host budget has room (``plan.make_plan`` counts them).
A step runs early only when the step before kept (or would have kept) every early result: where the norm is
above the clip every step, early runs would all be redone, and they take cores and memory bandwidth that the
backward's copies and the redo need (``StepStats.speculation_paused`` counts the steps that waited).

What it leaves out: deciding the verdict (``runtime.engine.commit``), running jobs (``runtime.update.worker``).
"""

from __future__ import annotations

import logging

import torch

from runtime.core.blocks import Block
from runtime.planning.memory_plan import STATE_KINDS
from tierstore import Allocation, CapacityError, TierName, TierStore

log = logging.getLogger(__name__)


class SpareBuffers:
    """Each speculating block's second host buffers for its master and moments, allocated at first use."""

    def __init__(self, store: TierStore):
        self.store = store
        self._spares: dict[int, dict[str, Allocation]] = {}
        self._refused: set[int] = set()  # blocks the host budget had no room for (not asked again)

    def can_speculate(self, block: Block) -> bool:
        """True when block's update may run out of place: its state lives in host memory and it has spares
        (allocated now if needed; a full host budget says no, once, in the log)."""
        index = block.index
        if index in self._spares:
            return True
        if index in self._refused or any(self.store.record(block.key(k)).home is not TierName.HOST for k in STATE_KINDS):
            return False
        spares: dict[str, Allocation] = {}
        try:
            for kind in STATE_KINDS:
                spares[kind] = self.store.allocate_spare(block.key(kind))
        except CapacityError:
            for spare in spares.values():
                self.store.free_spare(spare)
            if not self._refused:
                log.info("the host budget has no room for %s's second state buffers: its update waits for "
                         "optimizer.step() (tiers.host.budget: auto counts them)", block.name)
            self._refused.add(index)
            return False
        self._spares[index] = spares
        return True

    def targets(self, block: Block) -> dict[str, torch.Tensor]:
        """Block's spare flat tensors by kind, where an out-of-place update writes."""
        return {kind: spare.tensor for kind, spare in self._spares[block.index].items()}  # type: ignore[misc]

    def publish(self, block: Block, step: int) -> None:
        """Make the spares block's state (the store's host copies) and keep the old buffers as the new spares."""
        spares = self._spares[block.index]
        for kind in STATE_KINDS:
            spares[kind] = self.store.exchange_host(block.key(kind), spares[kind], step=step)

    def drop(self, index: int) -> None:
        """Give block ``index``'s spares back (its state left host memory: it no longer updates on the CPU)."""
        for spare in self._spares.pop(index, {}).values():
            self.store.free_spare(spare)

    def close(self) -> None:
        """Give every spare back to the host budget."""
        for spares in self._spares.values():
            for spare in spares.values():
                self.store.free_spare(spare)
        self._spares.clear()
