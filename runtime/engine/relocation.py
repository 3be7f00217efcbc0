"""Where each block's state lives: registered in the store at setup, and moved when a placement measured after the
first step gives the device a larger share of the update (``runtime.planning.measured_placement`` asks).

Setup registers every block's master, moments, host gradient and compute-dtype weights copy at its home, freeing the
model's host parameters block by block. A placement change moves the first blocks' master and moments to the device
(all or nothing), lets the next ones stream their state for the update, and brings spilled moments back to pinned
memory where they fit (``runtime.engine.spill_return``). What it leaves out: choosing the placement
(``runtime.planning``) and the step itself (the controller refuses a change while a step is pending).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from runtime.config.units import approx_size
from runtime.core.blocks import Block
from runtime.engine.block_state import BlockTable
from runtime.engine.fetch import Fetcher
from runtime.engine.gradients import HostSumSlots
from runtime.engine.options import RuntimeOptions
from runtime.engine.spill_return import bring_moments_home
from runtime.engine.step_phase import StepPhase
from runtime.engine.step_view import StepView
from runtime.engine.weights import WeightManager
from runtime.engine.writeback import DeviceWritebacks
from runtime.planning.auto_placement import gpu_streamed_blocks, gpu_updated_blocks
from runtime.planning.memory_plan import MOMENT_KINDS, WeightSource
from runtime.update.device_updates import DeviceUpdates
from runtime.update.moments import moment_storage, zero_moments
from runtime.update.worker import STATE_KINDS, UpdateWorker
from tierstore import CapacityError, TensorMeta, TierName, TierStore

log = logging.getLogger(__name__)

SETUP_PROGRESS_S = 10.0  # seconds between progress lines while blocks are registered (init, first writes)


def state_homes(block: Block, options: RuntimeOptions, table: BlockTable) -> dict[str, tuple[TensorMeta, TierName]]:
    """The state a block keeps from setup, in registration order, with each key's size and home tier: master and
    moments (on the device for a device-updated block, the moments on NVMe for a spilled one), the host gradient
    (not for a device-updated or streamed block: its gradient never leaves the device) and the compute-dtype
    weights copy (when that is the weight source, not for a device-updated block: it casts from its master)."""
    f32 = TensorMeta(torch.float32, block.numel)
    moments = TensorMeta(*moment_storage(options.moment_dtype, [slot.numel for slot in block.slots]))
    if block.index in table.gpu_updated:
        return {"master": (f32, TierName.GPU), **{kind: (moments, TierName.GPU) for kind in MOMENT_KINDS}}
    state = {"master": (f32, options.homes["master"])}
    for kind in MOMENT_KINDS:
        state[kind] = (moments, TierName.NVME if block.index in options.spilled_blocks else options.homes[kind])
    if block.index not in table.gpu_streamed:
        state["grad"] = (TensorMeta(options.host_grad_dtype, block.numel), TierName.HOST)
    if options.weight_source is WeightSource.WEIGHTS:
        state["weights"] = (TensorMeta(options.compute_dtype, block.numel), options.homes["weights"])
    return state


def register_state(store: TierStore, blocks: list[Block], table: BlockTable, options: RuntimeOptions,
                   fill_block: Callable[[Block], None] | None) -> None:
    """Register every block's master (from the model's current values, after ``fill_block`` filled those
    materialised from the meta device: ``runtime.model.materialize``), moments, host gradient and compute-dtype weights
    copy (when that is the weight source) in the store. Each block's host parameters are freed as soon
    as the block is in the store, so the model never exists twice on the host. A block another rank owns is
    neither filled nor registered: its parameters' values are dropped (the owner's are the block's).

    The pinned state is packed at the arena's end in forward order (``PinnedArena.packed_at_end``): the first
    blocks, the ones a placement adopted after the first step moves to the GPU, then free room next to the
    arena's free room, where spilled moments come back (``runtime.engine.spill_return``)."""
    homes = {block.index: state_homes(block, options, table) for block in blocks if not table[block.index].remote}
    host = store.tiers[TierName.HOST]
    pinned = sum(host.arena.reserved_size(meta.nbytes) for block_homes in homes.values()
                 for meta, home in block_homes.values() if home is TierName.HOST)
    start = reported = time.perf_counter()
    with host.arena.packed_at_end(pinned):  # the host tier is a HostTier
        for position, block in enumerate(blocks):
            if time.perf_counter() - reported >= SETUP_PROGRESS_S:  # a large model takes minutes: show progress
                reported = time.perf_counter()
                log.info("setting up block %d of %d (%.0f s so far)", position + 1, len(blocks), reported - start)
            if table[block.index].remote:  # another rank keeps it ([Note: block ownership]): never materialized here
                for slot in block.slots:
                    slot.param.data = torch.empty(0, dtype=slot.param.dtype, device=slot.param.device)
                continue
            if fill_block is not None:
                fill_block(block)
            master = torch.cat([slot.param.detach().reshape(-1).to(torch.float32) for slot in block.slots])
            for kind, (meta, home) in homes[block.index].items():  # keys without a value: zero-filled by the store
                value = master if kind == "master" else master.to(meta.dtype) if kind == "weights" else None
                if kind in MOMENT_KINDS and options.moment_dtype != "fp32":
                    value = _zero_moment(meta, options.moment_dtype, block)
                store.register(block.key(kind), meta, home, init=value)
            # Only now: a registration that fails (a disk filling, Ctrl-C) leaves this block's values in the model,
            # and offload() gives back the blocks before it from the store.
            for slot in block.slots:
                slot.param.data = torch.empty(0, dtype=slot.param.dtype, device=slot.param.device)


def _zero_moment(meta: TensorMeta, moment_dtype: str, block: Block) -> torch.Tensor | None:
    """A compact moment's initial stored value: zeros in its encoding, or None where that is all zero bytes (the
    store's own zero fill, which writes only a header to a new NVMe home)."""
    value = torch.empty(meta.numel, dtype=meta.dtype)
    zero_moments(value, moment_dtype, [slot.numel for slot in block.slots])
    return None if not value.view(torch.uint8).any() else value


class Relocation:
    """Moves blocks' state between steps when the device takes a larger share of the update."""

    def __init__(self, view: StepView, table: BlockTable, blocks: list[Block], store: TierStore, weights: WeightManager,
                 worker: UpdateWorker, device_updates: DeviceUpdates, writebacks: DeviceWritebacks, fetch: Fetcher,
                 host: HostSumSlots, param_steps: dict[int, list[torch.Tensor]], broken: Callable[[str], None]):
        self.view = view
        self.table = table
        self.blocks = blocks
        self.store = store
        self.device = store.device
        self.weights = weights
        self.worker = worker
        self.device_updates = device_updates
        self.writebacks = writebacks
        self.fetch = fetch
        self.host = host
        self.param_steps = param_steps  # device-updated and streamed blocks' AdamW step counters, on the device
        self.broken = broken  # the session can't go on, saying why: no load mends it

    def adopt(self, update_fraction: float, stream_fraction: float, keep_for_backward_nbytes: int,
              spilled_blocks: frozenset[int] | None = None) -> RuntimeOptions:
        """Between steps, give the device a larger share of the update: the first blocks ``update_fraction`` selects
        move their master and moments to the device and update there (their micro-batch gradients then sum on the
        device, not in host memory), the next ones ``stream_fraction`` selects stream their state for the update, and
        a forward keeps up to ``keep_for_backward_nbytes`` of weights for its backward. ``spilled_blocks``: the blocks
        whose moments are to stay on NVMe (None: those spilled now, less the ones moved to the device); the other
        spilled blocks' moments come back to pinned memory as far as its room allows (``runtime.engine.spill_return``).
        Waits for every committed update first. The device's share only grows (a block updated on the device stays
        there) and the spill only shrinks. Returns the options of the new placement."""
        options, table = self.view.options, self.table
        owned = [block for block in self.blocks if not table[block.index].remote]  # the fractions count these
        updated = gpu_updated_blocks(owned, update_fraction)
        streamed = gpu_streamed_blocks(owned, update_fraction, stream_fraction)
        spilled_now = options.spilled_blocks
        staying = (spilled_now if spilled_blocks is None else spilled_blocks) - updated
        self._check(updated, streamed, staying)
        self.worker.synchronize(self.view.optimizer_step)
        self.writebacks.wait_all()
        for index, state in enumerate(self.weights.states):  # fetched weights: fetched again as the new placement says
            if state.users == 0:
                self.fetch.release(index)
        self.device_updates.fresh.clear()
        if self.device.type == "cuda":  # weight refreshes and fetches may still read host masters that move below
            torch.cuda.synchronize(self.device)
        arriving = sorted(updated - table.gpu_updated)
        need = sum(self._state_nbytes(i) + (0 if self.weights.states[i].resident else self.weights.nbytes(i))
                   for i in arriving)
        gpu = self.store.tiers[TierName.GPU]
        if need > gpu.free_nbytes:  # checked first: a block moved half-way would be neither here nor there
            raise CapacityError("gpu", need, gpu.used_nbytes, gpu.capacity_nbytes,
                                f"the master and moments of {len(arriving)} more device-updated blocks")
        leaving_cpu = sorted((updated | streamed) - table.gpu_updated - table.gpu_streamed)
        asked_back = spilled_now - updated - staying
        log.info("placement change: %d blocks' master and moments move to the GPU (%s with their compute weights), %d "
                 "more stream their update%s", len(arriving), approx_size(need), len(streamed - table.gpu_streamed),
                 f"; the moments of {len(asked_back)} spilled blocks are asked back from NVMe" if asked_back else "")
        # Device step counters first: after the move nothing may fail for want of device memory.
        steps = {i: [count.to(self.device, copy=True) for count in self.worker.param_steps[i]] for i in leaving_cpu}
        self._move_state_to_device(arriving)
        try:  # past the move nothing is expected to fail; should it, the blocks are neither here nor there
            self._leave_cpu(leaving_cpu, steps, arriving)
        except BaseException as error:
            self.broken(f"a placement change failed after moving blocks to the device ({error!r}); start a new "
                        "process from the last checkpoint")
            raise
        table.place(updated, streamed, spilled_now)
        self.weights.gpu_updated = updated
        # Spilled blocks stay where they are unless they fit (it never raises): the placement is adopted either way.
        spilled = bring_moments_home(self.store, self.blocks, sorted(asked_back), staying)
        table.place(updated, streamed, spilled)
        self.device_updates.placement_changed(updated, streamed)
        return dataclasses.replace(options, gpu_update_fraction=update_fraction, gpu_stream_fraction=stream_fraction,
                                   keep_for_backward_nbytes=keep_for_backward_nbytes, spilled_blocks=spilled)

    def _state_nbytes(self, index: int) -> int:
        """Bytes of block ``index``'s master and moments as stored (``optimizer.moment_dtype``)."""
        return sum(self.store.record(self.blocks[index].key(kind)).meta.nbytes for kind in STATE_KINDS)

    def _check(self, updated: frozenset[int], streamed: frozenset[int], staying: frozenset[int]) -> None:
        """Refuse a change the engine cannot make: during a step, taking blocks from the device, spilling more."""
        phase, spilled_now, table = self.view.phase, self.view.options.spilled_blocks, self.table
        if phase is not StepPhase.IDLE:
            raise RuntimeError(f"a placement changes only between steps (the step is {phase.value})")
        if not table.gpu_updated <= updated or not table.gpu_streamed <= updated | streamed:
            raise RuntimeError("a placement change may only give the device more blocks to update")
        if not staying <= spilled_now:
            raise RuntimeError("a placement change may only bring spilled moments back to host memory")
        if streamed & spilled_now:  # a streamed update copies its moments from pinned memory
            raise RuntimeError("a placement change cannot stream blocks whose moments are spilled to NVMe")

    def _leave_cpu(self, leaving_cpu: list[int], steps: dict[int, list[torch.Tensor]], arriving: list[int]) -> None:
        """The blocks no longer updated on the CPU drop what only the CPU's update used: spare buffers, host sums,
        the host gradient; the ones whose master moved cast their weights from it, not from a host copy."""
        host, store = self.host, self.store
        for index in leaving_cpu:
            block = self.blocks[index]
            self.worker.spares.drop(index)  # no longer updated on the CPU
            self.param_steps[index] = steps[index]
            if host.sums is not None:  # its micro-batches now sum on the device
                host.sums.release(index)
            if store.has(block.key("grad")):  # its gradient no longer leaves the device
                store.unregister(block.key("grad"))
        if host.sums is not None and not host.sums.blocks:  # nothing left to sum on the host: its buffers go too
            host.sums.close()
            host.sums = None
        for index in arriving:
            if store.has(self.blocks[index].key("weights")):  # cast from the device master from now on
                store.unregister(self.blocks[index].key("weights"))

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
                self.broken(f"a failed placement change left {', '.join(stuck)} on the device while the block updates "
                            "on the CPU; start a new process from the last checkpoint")
            raise
