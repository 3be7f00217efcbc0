"""Reading and writing a block's training state between steps, from the user's side of the model.

The update pipeline owns every block's state while a step runs. Between steps the user may read weights
(a parameter, ``state_dict()``), write them (``load_state_dict``, ``p.copy_(...)``) or read and load the
optimizer's moments. This module is the one place that does so safely: it waits for the updates of the
committed step (and the write-backs they started), brings the state to where it can be touched (staging it
from NVMe when it lives there), and after a write refreshes the compute copies derived from the master.

What it leaves out: deciding *when* a read is needed (``runtime.model.param_guard``) and the optimizer's torch
surface (``runtime.model.optimizer``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from runtime.core.blocks import Block
from runtime.core.ranks import COLLECTIVE_TIMEOUT_S
from runtime.engine.step_phase import StepPhase
from runtime.engine.step_view import StepView
from runtime.engine.weights import WeightManager
from runtime.engine.writeback import DeviceWritebacks
from runtime.model.remote_reads import RemoteReader
from runtime.planning.hostmem import host_memory
from runtime.planning.memory_plan import MOMENT_KINDS, WeightSource
from runtime.update.moments import decode_moment, encode_moment
from runtime.update.worker import UpdateWorker
from tierstore import CapacityError, CopyState, TierName, TierStore

log = logging.getLogger(__name__)

STEPS = "steps"  # what own_copy gives for a block's AdamW step counters (one per parameter), beside its state kinds
OWNER_WAIT_S = COLLECTIVE_TIMEOUT_S / 2  # how long a read waits for this rank to reach the requester's state


class StateHolder(Protocol):
    """What a refresh of compute weights reads: the weights, the store and which blocks update on the device."""

    @property
    def weights(self) -> WeightManager:
        """The blocks' compute weights."""

    @property
    def store(self) -> TierStore:
        """The store holding each block's state."""

    @property
    def gpu_updated(self) -> frozenset[int]:
        """Blocks whose master lives on the device (their weights are always resident)."""


def refresh_compute_weights(holder: StateHolder, block: Block, master: torch.Tensor, step: int) -> None:
    """Bring block's kept compute weights in line with a newly written fp32 master (after a load or a user's
    write), the way the update worker does: resident weights are recast from it, a host copy in the compute
    dtype is rewritten (and written back when its home is NVMe). Fetched-on-demand weights need nothing: they
    are read from the master at their next fetch."""
    weights, store = holder.weights, holder.store
    if block.index in holder.gpu_updated or weights.source is WeightSource.RESIDENT:
        weights.load_resident(block.index, master)
    elif weights.source is WeightSource.WEIGHTS:
        key = block.key("weights")
        for copy in store.record(key).copies.values():  # a transfer of this key in flight lands first
            if copy.handle is not None:
                copy.handle.wait()
        store.fetch(key, TierName.HOST).wait()
        store.tensor(key, TierName.HOST).copy_(master)  # cast to the compute dtype
        store.mark_dirty(key, TierName.HOST, step=step)
        if store.record(key).home is TierName.NVME:
            store.evict(key, TierName.HOST, release=False).wait()


class StateAccess:
    """Between-step reads and writes of blocks' weights, masters and moments."""

    def __init__(self, view: StepView, blocks: list[Block], store: TierStore, weights: WeightManager, worker: UpdateWorker,
                 writebacks: DeviceWritebacks, release_block: Callable[[int], None]):
        self.view = view
        self.blocks = blocks
        self.store = store
        self.weights = weights
        self.worker = worker
        self.writebacks = writebacks  # streamed state on its way home: a read waits for it
        self.release_block = release_block  # frees a block's fetched compute weights (the engine's fetch side)
        # While a load_state_dict() runs, master writes of one block are gathered: staged once, written back and
        # their compute weights refreshed once, when the load ends (or before anything reads them).
        self._batch: set[int] | None = None
        self.mixed_steps_allowed = False  # close(): hand the weights back even when an abandoned step mixed them
        # Several processes: blocks other ranks own are read through their read services ([Note: reads served by
        # the owner]); close() reads them by broadcast instead (every rank closes together).
        self.remote: RemoteReader | None = None
        self.broadcast_reads = False
        self.writes = [0] * len(blocks)  # between-step writes of each block so far (a remote block's counted too)
        self.written_event: torch.cuda.Event | None = None  # after the last write's device work (count_write)

    # ---- batched writes (load_state_dict) --------------------------------------------------------------
    def begin_batch(self) -> None:
        """Gather the master writes that follow until ``end_batch`` (or the next read)."""
        if self._batch is None:
            self.before_writes("load_state_dict")
            self._batch = set()

    @property
    def in_batch(self) -> bool:
        """Whether the writes of a ``load_state_dict`` are being gathered now."""
        return self._batch is not None

    def end_batch(self) -> None:
        """Write back the gathered blocks' masters and refresh their compute weights."""
        batch, self._batch = self._batch, None
        for index in sorted(batch or ()):
            block = self.blocks[index]
            key = block.key("master")
            if self.store.record(key).home is TierName.NVME:
                self.store.evict(key, TierName.HOST).wait()  # written back home, then the staging copy released
            self._refresh_compute(block)

    @property
    def gpu_updated(self) -> frozenset[int]:
        """Blocks whose master lives on the device (``StateHolder``, for ``refresh_compute_weights``)."""
        return self.view.gpu_updated

    # ---- compute weights -------------------------------------------------------------------------------
    def in_pass(self, index: int) -> bool:
        """True while block index is acquired by a forward or backward (its weights are current on the device)."""
        return self.weights.states[index].users > 0 or self.view.in_backward_use(index)

    def prepare_read(self, index: int) -> None:
        """Make block index's compute weights current on the device for a read outside forward/backward.

        A fetched block stays until the next forward begins (views the user took stay valid until then);
        when the GPU budget is full, blocks fetched for earlier reads are released first (views of them
        are guarded too and fetch again when read)."""
        view = self.view
        self.end_batch()  # a read sees every write before it
        self._check_one_step()
        if view.update_under_way(index):
            raise RuntimeError(
                f"block {self.blocks[index].name} is being updated: its gradient landed and, with streaming updates, "
                "its update started before optimizer.step(). Read parameters after optimizer.step() (or set "
                "optimizer.user_grad_clip: true, so that updates wait for the step and reads before it see the "
                "pre-step weights, as in plain PyTorch)")
        self.worker.wait_updated(index, view.optimizer_step)
        if self.weights.source is WeightSource.RESIDENT or index in view.gpu_updated:
            self.weights.wait_refresh(index)
            return
        try:
            self.weights.wait(index)
        except CapacityError:
            for other, state in enumerate(self.weights.states):
                if other != index and state.users == 0 and not self.in_pass(other):
                    self.release_block(other)
            self.weights.wait(index)

    # ---- fp32 state --------------------------------------------------------------------------------------
    def settle(self, writing: bool = False, *, read_only: bool = False) -> None:
        """Wait for every committed update, its write-backs and its weight refreshes; unless ``writing`` (another
        write of a batch), finish the batched writes first. ``read_only``: a read, which may also come between
        micro-batches (a state_dict saved at an epoch's end with micro-batches left over, after an evaluation
        mid-window): no block changes before the step's last backward, so it reads the last step's state."""
        view = self.view
        view.check_open()
        if not writing or view.step_pending:
            self.end_batch()
        if view.step_pending and not (read_only and view.phase is StepPhase.ACCUMULATING):
            if view.phase is StepPhase.ACCUMULATING:  # a write: reads are served here
                raise RuntimeError(
                    "writing parameters or optimizer state between the micro-batches of a step (a backward ran since "
                    "the last optimizer.step()) is refused: write them between steps (after optimizer.step(), or after "
                    "optimizer.zero_grad() to drop the pending step). Reads work here and give the last step's state")
            raise RuntimeError(
                "the training state is being updated: a backward ran since the last optimizer.step(). Read or "
                "write parameters and optimizer state between steps (after optimizer.step(), or after "
                "optimizer.zero_grad() to drop the pending step)")
        self.worker.synchronize(view.optimizer_step)
        self.writebacks.wait_all()
        self.weights.release_refreshes()
        if self.store.device.type == "cuda":
            torch.cuda.synchronize(self.store.device)

    def read_state(self, block: Block, kind: str, use: Callable[[torch.Tensor], None]) -> None:
        """Call ``use`` with block's flat fp32 tensor of one kind (master, exp_avg, exp_avg_sq) where it can be
        read (host, or the GPU for device-updated blocks; compact moments decoded into a new fp32 tensor); a copy
        staged from NVMe is released afterwards. Call ``settle()`` first."""
        self._check_one_step()
        options = self.view.options
        served = self.remote is not None and not self.broadcast_reads  # (a remote reader: several processes)
        if options.ranks is None or (served and not self.weights.is_remote(block.index)):
            self._with_state(block, kind, self._decoded(block, kind, use, write=False), write=False)
            return
        # Several processes: a block another rank owns comes from its read service ([Note: reads served by the owner]),
        # or, at close(), the owner's values are broadcast to every rank; each calls this for the same blocks in the
        # same order then ([Note: collectives in program order] in runtime.core.ranks).
        ranks, owner = options.ranks, options.owners[block.index]
        if served:
            assert self.remote is not None
            use(self.remote.read(owner, block.index, kind, self.view.optimizer_step, self.writes[block.index],
                                 nbytes=4 * block.numel))
            return
        values = torch.empty(block.numel, dtype=torch.float32, device=ranks.device)
        if owner == ranks.rank:

            def keep(stored: torch.Tensor) -> None:
                values.copy_(stored)

            self._with_state(block, kind, self._decoded(block, kind, keep, write=False), write=False)
        ranks.broadcast(values, owner)
        use(values)

    def _decoded(self, block: Block, kind: str, use: Callable[[torch.Tensor], None], write: bool) -> Callable[[torch.Tensor], None]:
        """``use`` as it sees a moment stored compactly (``optimizer.moment_dtype``): decoded to fp32 and, after a
        write, encoded back into the stored buffer. Anything else is given as it is stored (fp32)."""
        moment_dtype = self.view.options.moment_dtype
        if kind not in MOMENT_KINDS or moment_dtype == "fp32":
            return use
        sizes = [slot.numel for slot in block.slots]

        def through_fp32(stored: torch.Tensor) -> None:
            values = decode_moment(stored, moment_dtype, kind, sizes)
            use(values)
            if write:
                encode_moment(values, moment_dtype, kind, sizes, stored)

        return through_fp32

    def _check_one_step(self) -> None:
        """Reads hand out one step's values: refused (with the way back) while an abandoned streaming step left
        the blocks at different steps, where a state_dict, a save or a parameter read would silently mix the
        updated blocks with the others. ``close()`` reads anyway, under ``mixed_steps_allowed``, and says so."""
        why = self.view.interrupted
        if why is not None and not self.mixed_steps_allowed:
            raise RuntimeError(f"reading parameters or optimizer state now would mix two steps: {why}")

    def write_state(self, block: Block, kind: str, apply: Callable[[torch.Tensor], None]) -> None:
        """Modify block's flat fp32 tensor of one kind in place through ``apply`` (a compact moment: its decoded
        values, encoded back after); it is written back to its home, and after a master write the compute weights
        derived from it are refreshed. Call ``settle()`` first."""
        if self.weights.is_remote(block.index):  # another rank owns it and writes the same values there
            self.count_write(block.index)  # (a read of it waits until its owner made as many: own_copy)
            return
        if kind == "master" and self._batch is not None:
            self._with_state(block, kind, apply, write=True, keep_staged=True)
            self._batch.add(block.index)
            self.count_write(block.index)
            return
        self._with_state(block, kind, self._decoded(block, kind, apply, write=True), write=True)
        if kind == "master":
            self._refresh_compute(block)
        self.count_write(block.index)

    def before_writes(self, what: str) -> None:
        """Several processes: a write of the state between steps (``what``: a load, a parameter's write) is about to
        start. Every rank makes the same writes in the same order, as DDP's ranks do; here every rank waits until all
        have come, so every read another rank made of the state before it has been served ([Note: reads served by
        the owner]): no owner moves past a state a reader still asks for. A read after it waits in ``own_copy``
        until the owner has made as many writes of the block."""
        ranks = self.view.options.ranks
        if ranks is not None and self.remote is not None:
            ranks.barrier(f"{what} (between steps, on every rank)")

    def count_write(self, index: int) -> None:
        """Block ``index``'s state was written between steps (by ``write_state``, or a load's step counters): a read
        after it waits until the owner did it too. On a GPU with several processes the event after the write's
        device work is recorded first, so a read that sees the count waits for that work too."""
        if self.remote is not None and self.store.device.type == "cuda":
            self.written_event = torch.cuda.current_stream(self.store.device).record_event()
        self.writes[index] += 1

    def step_counters(self, block: Block) -> list[torch.Tensor]:
        """The AdamW step counters of block's parameters: this rank's, or, for a block another rank owns and updates,
        its owner's ([Note: reads served by the owner]: this rank's count only the updates it saw). Call ``settle()``
        first."""
        if self.remote is None or not self.weights.is_remote(block.index):
            return self.view.param_steps(block.index)
        owner = self.view.options.owners[block.index]
        return list(self.remote.read(owner, block.index, STEPS, self.view.optimizer_step, self.writes[block.index]))

    def own_copy(self, index: int, kind: str, step: int, writes: int) -> torch.Tensor:
        """Several processes, for the read service (another thread): this rank's block ``index``'s fp32 values of
        ``kind`` (or its step counters: ``STEPS``) as a CPU tensor, once this rank has committed ``step``, the block's
        update to it is done and this rank has made the ``writes`` writes of the block the requester made, as every
        rank makes them ([Note: reads served by the owner] in runtime.model.remote_reads). Read from a snapshot
        (``TierStore.snapshot``): nothing is staged or released under the owner's own threads. Raises where this rank
        is past that state (it cannot be, where every rank writes alike) or does not reach it in time."""
        deadline = time.monotonic() + OWNER_WAIT_S  # (before the requester's: its error names why)
        while self.view.optimizer_step < step or self.writes[index] < writes:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"block {index} was asked for at step {step} after {writes} writes of it between steps; this rank "
                    f"is at step {self.view.optimizer_step} after {self.writes[index]} after {OWNER_WAIT_S:g} s: write "
                    "parameters and load state on every rank, as DDP's ranks do")
            time.sleep(0.001)
        # Under NCCL this rank's CPU may have committed the next step already, its device work waiting for the rank
        # reading (every step reduces every rank's gradients): the state is still the step asked for. A block the
        # CPU updated past it, or a write more, is not.
        if self.view.optimizer_step > step + 1 or self.writes[index] > writes or \
                (self.worker.updated_step(index) > step and index not in self.view.gpu_updated):
            raise RuntimeError(f"block {index} was asked for at step {step} after {writes} writes of it; this rank has "
                               f"moved on to step {self.view.optimizer_step} after {self.writes[index]}: read the state "
                               "before the next step or write, on every rank")
        self.worker.wait_updated(index, step)
        for event in (self.view.committed_event(step), self.written_event):  # that device work, nothing later
            while event is not None and not event.query():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"block {index}: the device work of step {step} did not end in {OWNER_WAIT_S:g} s")
                time.sleep(0.001)
        block = self.blocks[index]
        if kind == STEPS:
            return torch.stack([s.detach().to("cpu", torch.float32, copy=True) for s in self.view.param_steps(index)])
        out: list[torch.Tensor] = []
        self._decoded(block, kind, out.append, write=False)(self._snapshot(block.key(kind), deadline))
        return out[0]

    def _snapshot(self, key: str, deadline: float) -> torch.Tensor:
        """``TierStore.snapshot``, read again where the state was moving home meanwhile (the measured placement after
        the first step re-registers the blocks it moves)."""
        while True:
            try:
                return self.store.snapshot(key)
            except (KeyError, RuntimeError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _with_state(self, block: Block, kind: str, use: Callable[[torch.Tensor], None], write: bool,
                    keep_staged: bool = False) -> None:
        store, key = self.store, block.key(kind)
        record = store.record(key)
        tier = TierName.GPU if record.home is TierName.GPU else TierName.HOST
        staged = tier is TierName.HOST and not store.state(key, TierName.HOST).is_current
        if tier is TierName.HOST:
            store.fetch(key, TierName.HOST).wait()  # stages it when the home is NVMe
        use(store.tensor(key, tier))
        if write:
            store.mark_dirty(key, tier, step=record.step)  # every other copy is stale now
        if record.home is TierName.NVME and (write or staged) and not keep_staged:
            if write:
                store.evict(key, TierName.HOST).wait()  # written back home, then the staging copy released
            else:
                store.release(key, TierName.HOST)

    def _refresh_compute(self, block: Block) -> None:
        """Bring block's compute weights in line with its master after a write."""
        index = block.index
        if self.weights.source is not WeightSource.MASTER or index in self.view.gpu_updated:
            step = self.store.record(block.key("master")).step
            # Not read_state: this follows a write (also one made while an abandoned step left blocks at two
            # steps, which reads refuse), and the compute copy must follow the master whatever the phase.
            self._with_state(block, "master", lambda master: refresh_compute_weights(self, block, master, step),
                             write=False)
        # A fetched copy holds the old values: drop it (views of it fetch again when read).
        if self.weights.states[index].users == 0:
            self.release_block(index)

    # ---- whole-model reads -----------------------------------------------------------------------------
    def slot_values(self, kind: str, dtypes: dict[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
        """Every offloaded parameter's tensor of one kind as CPU tensors by parameter name (cast to
        ``dtypes[name]`` when given), one block at a time. Refuses, naming the numbers, when they would not
        fit in the RAM available now."""
        needed = sum(slot.numel * (dtypes[slot.name].itemsize if dtypes else 4) for b in self.blocks for slot in b.slots)
        memory = host_memory()
        available = memory.available_nbytes
        if needed > available:
            raise MemoryError(
                f"copying the model's {kind} to host memory needs {needed:,} bytes but {available:,} are available "
                f"(under {memory.limit}); "
                "write it block by block instead: optimizer.session.save_pretrained(DIR) for weights, "
                "runtime.checkpoint.state.save_checkpoint(session, DIR) for the whole training state")
        self.settle(read_only=True)
        out: dict[str, torch.Tensor] = {}
        for block in self.blocks:
            out.update(self.block_values(block, kind, dtypes))
        return out

    def own_values(self, kind: str, blocks: list[Block], dtypes: dict[str, torch.dtype] | None = None
                   ) -> dict[str, torch.Tensor]:
        """``slot_values`` of ``blocks``, read here with no collective: this process's own blocks, after a run of
        several processes failed (``close()``)."""
        self.settle(read_only=True)
        out: dict[str, torch.Tensor] = {}
        for block in blocks:
            out.update(self.block_values(block, kind, dtypes, here_only=True))
        return out

    def salvage_masters(self, dtypes: dict[str, torch.dtype]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """After the optimizer worker failed (``close()``): every block's master that can be read, as CPU tensors by
        parameter name cast to ``dtypes[name]``, without waiting for updates that will never run; and, by parameter
        name, why one is not at the committed step or not given at all. A block whose update to the committed step
        did not finish is read as its last finished update left it: an NVMe home's file, not a copy in host memory
        that the failed update may have changed half-way; a master in host memory has no other copy, so it is given
        as it is and named (the failed update may have changed part of it)."""
        store, worker = self.store, self.worker
        committed = self.view.optimizer_step
        worker.drain()  # the write-backs still in flight land (or fail) first
        values: dict[str, torch.Tensor] = {}
        notes: dict[str, str] = {}
        for block in self.blocks:
            key, done = block.key("master"), worker.updated_step(block.index)
            record = store.record(key)
            doubt = None
            if done < committed and record.step <= done:  # its update to the committed step did not get to its commit
                if record.home is TierName.NVME:
                    if store.state(key, TierName.HOST) is CopyState.CLEAN:  # read again from the file
                        store.release(key, TierName.HOST)
                    doubt = f"given back at step {done}: its update to step {committed} did not run or failed"
                elif record.home is TierName.HOST:
                    doubt = (f"given back at step {done}, its update to step {committed} did not run or failed: where it "
                             "failed inside AdamW, its weights may be partly updated")
            try:
                values.update(self.block_values(block, "master", dtypes))
            except Exception as error:  # a corrupt or unreadable master: named, the other blocks still given
                notes.update({slot.name: f"left on the meta device: its master could not be read ({error!r})"
                              for slot in block.slots})
                continue
            if doubt is not None:
                notes.update({slot.name: doubt for slot in block.slots})
        return values, notes

    def block_values(self, block: Block, kind: str, dtypes: dict[str, torch.dtype] | None = None, *,
                     here_only: bool = False) -> dict[str, torch.Tensor]:
        """Block's parameters' tensors of one kind as CPU copies by name (cast to ``dtypes[name]`` when given).
        Call ``settle()`` first. ``here_only``: read this process's copy, with no collective (a block it owns)."""
        out: dict[str, torch.Tensor] = {}

        def take(flat: torch.Tensor) -> None:
            for slot in block.slots:
                view = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
                out[slot.name] = view.to(device="cpu", dtype=dtypes[slot.name] if dtypes else view.dtype, copy=True)

        if here_only:
            self._with_state(block, kind, self._decoded(block, kind, take, write=False), write=False)
        else:
            self.read_state(block, kind, take)
        return out

