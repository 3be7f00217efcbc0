"""GPU residency of each block's compute weights.

Each block has one flat buffer of the compute dtype on the device; the block's parameters are views into
it, bound once. When the block is not resident its storage is resized to zero bytes (the views stay, so
tensors saved by autograd in forward see the refetched bytes in backward). A fetch is an H2D copy from the
block's host source: the fp32 master in pieces, each cast on the GPU's copy stream ([Note: fetch staging]), or a
separate host copy in the compute dtype, whole; a release resizes the storage back to zero. GPU bytes are
reserved against the GPU tier's budget.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.core.blocks import Block
from runtime.core.ranks import Ranks
from runtime.planning.buffers import FETCH_PIECE_NUMEL
from runtime.planning.memory_plan import WeightSource
from tierstore import CapacityError, Handle, TierName, TierStore

log = logging.getLogger(__name__)



@dataclass
class BlockWeights:
    """The device-side state of one block's weights."""

    block: Block
    flat: torch.Tensor
    resident: bool = False
    handle: Handle | None = None  # the fetch in flight
    users: int = 0  # modules running forward / backward with these weights now
    prefetched: bool = False  # the fetch was issued ahead of the need


class WeightManager:
    """Fetches, waits for and releases blocks' compute weights on the device."""

    def __init__(self, blocks: list[Block], store: TierStore, compute_dtype: torch.dtype, source: WeightSource,
                 gpu_updated: frozenset[int] = frozenset(), ranks: Ranks | None = None, owners: tuple[int, ...] = ()):
        self.gpu_updated = gpu_updated  # blocks whose optimizer runs on the device: weights always resident
        # Several processes: each block's weights come from its owner's fetch, broadcast at every wait ([Note: block
        # ownership] in runtime.planning.ownership, [Note: collectives in program order] in runtime.core.ranks).
        self.ranks = ranks
        self.owners = owners
        # Broadcasts started ahead of their block's acquire (gather_ahead), by block: the wait that acquire makes.
        self._gathers: dict[int, Callable[[], None]] = {}
        self.gathered_ahead = 0  # acquires whose broadcast had been started ahead (several processes)
        self.held_hits = 0  # acquires of a held block, no broadcast ([Note: held blocks are not broadcast again])
        self.store = store
        self.device = store.device
        self.compute_dtype = compute_dtype
        self.source = source
        self._gpu_tier = store.tiers[TierName.GPU]
        self.states: list[BlockWeights] = []
        for block in blocks:
            flat = torch.empty(block.numel, dtype=compute_dtype, device=self.device)
            for slot in block.slots:
                slot.param.data = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
            flat.untyped_storage().resize_(0)
            self.states.append(BlockWeights(block, flat))
        # fetch / wait / release come from the training thread and the optimizer worker (a fetch issued
        # the moment an update lands): one lock keeps a block's state changes whole.
        self._lock = threading.RLock()
        # RESIDENT refreshes queued behind hold_refreshes(): block index -> staging. None: they go out at once.
        self._held_refreshes: dict[int, torch.Tensor] | None = None
        self._staging: torch.Tensor | None = None  # of master fetches, made at the first ([Note: fetch staging])

    def cut_off(self) -> list[str]:
        """Names of parameters that no longer view their block's weights: ``p.set_(t)`` (which reaches no
        torch-function override, so the parameter guard never sees it) gave them memory of their own, which no
        fetch writes and no update reaches."""
        names = []
        with torch._C.DisableTorchFunctionSubclass():
            for state in self.states:
                storage = state.flat.untyped_storage()._cdata
                names += [slot.name for slot in state.block.slots if slot.param.untyped_storage()._cdata != storage]
        return names

    @property
    def needs_cast(self) -> bool:
        """True when fetched bytes are fp32 master and the compute dtype differs."""
        return self.source is not WeightSource.WEIGHTS and self.compute_dtype != torch.float32

    def source_key(self, block: Block) -> str:
        """The store key fetched for block's weights."""
        return block.key("weights" if self.source is WeightSource.WEIGHTS else "master")

    def nbytes(self, index: int) -> int:
        """Device bytes of a resident block (compute dtype)."""
        state = self.states[index]
        return state.block.numel * state.flat.element_size()

    def is_fetched(self, index: int) -> bool:
        """Resident or on its way."""
        state = self.states[index]
        return state.resident or state.handle is not None

    # ---- fetch / wait / release ----------------------------------------------------------------------
    def fetch(self, index: int, prefetch: bool = False) -> None:
        """Issue the H2D copy of block index's weights (no-op when resident or in flight)."""
        with self._lock:
            self._fetch(index, prefetch)

    def _fetch(self, index: int, prefetch: bool) -> None:
        state = self.states[index]
        if state.resident or state.handle is not None or self.is_remote(index):
            return
        key = self.source_key(state.block)
        host_handle = self.store.fetch(key, TierName.HOST)  # stages from NVMe when the source lives there
        host_handle.wait()
        src = self.store.tensor(key, TierName.HOST)
        if not self.needs_cast and src.dtype != state.flat.dtype:
            raise RuntimeError(f"{key} is {src.dtype}, compute weights are {state.flat.dtype}")
        self._gpu_tier.reserve(self.nbytes(index), f"{state.block.name} weights")
        # [Note: weights in the compute stream's pool] The weights are allocated on the caller's (compute) stream and
        # the copy is ordered after the work queued there so far. Allocated on the copy stream they lived in its
        # own pool: under a memory cap the compute stream's activations and the copy stream's weights took each
        # other's room only through the allocator's retry (each one synchronizing on every pending free's event,
        # then on the stream, the GPU idle meanwhile: 40 retries a step in the 8B scenario), and every release
        # recorded an event on the compute stream. In one pool a release frees at once, ordered by the stream,
        # for the next fetch or activation. The order costs a prefetch nothing in practice: it is issued at most
        # ``depth`` blocks ahead, where the compute has long passed the point it waits for; but copies queued on the
        # copy stream after it (a streamed update's state) wait behind it. A fetch the optimizer worker issues comes
        # from that thread's stream (the default one): a release from another stream records its use there.
        try:
            state.flat.untyped_storage().resize_(self.nbytes(index))
            if self.needs_cast:
                state.handle = self._fetch_and_cast(key, src, state.flat)
            else:
                state.handle = self.store.engine.h2d(key, src, state.flat, dst_waited=True)
        except BaseException:  # no room for the weights (or, at the first fetch, the staging buffer): the block holds nothing
            self._free_after_copies(state.flat)
            self._gpu_tier.unreserve(self.nbytes(index))
            raise
        state.prefetched = prefetch

    def _fetch_and_cast(self, key: str, src: torch.Tensor, flat: torch.Tensor) -> Handle:
        """H2D the fp32 master ``src`` a piece at a time through the staging buffer, each piece cast into the
        compute-dtype weights ``flat`` on the copy stream right after its copy; the handle of the last piece (the
        stream runs them in order, so waiting on it waits for all), or of the first that failed to issue.

        [Note: fetch staging] The staging is one buffer of ``FETCH_PIECE_NUMEL`` fp32 elements at most (the largest
        block's size when smaller), allocated on the copy stream at the first fetch and kept: only that stream
        uses it, in issue order, so one piece and the next need no other ordering, and the allocator never sees
        it freed (a buffer per fetch, taken from and given back to the pools in the loop, fed the allocator's
        retries under a cap, [Note: weights in the compute stream's pool]). Casting at the compute stream's wait
        held a whole fp32 copy of every block in flight: up to 4.39 GiB of the 8B scenario's 24 GiB (the 2.1 GB
        head and three layers). The cast is the same ``copy_``, on another stream: the same bits (GPU tests, call
        L7). The memory plan counts one piece (``runtime.planning.memory_plan``). The copy stream idles while a piece is cast (54 ms
        of each 0.5 s forward of the 8B scenario, the cast waiting for SMs behind the compute stream's GEMM); two
        buffers, each piece cast on a high-priority stream of its own while the next one crossed, kept the copies
        back to back and were exact, but slower (call Q2, an H100, the 8B width at 16 layers, same machine: steady
        steps 23.2 / 22.8 s against 20.5 / 20.3, the host gradient sums 30% slower beside the faster copies: host
        memory, not PCIe, is what the micro-batches share). Each piece is its own transfer event (a
        profile's transfer counts count pieces; a fetch stall's device wait sums them)."""
        staging = self._fetch_staging()
        piece = min(flat.numel(), staging.numel())
        # Ordered after the compute stream's queued work once, for the first piece: the later pieces follow it
        # on the copy stream.
        order = True
        handle: Handle | None = None
        for begin in range(0, flat.numel(), piece):
            end = min(flat.numel(), begin + piece)
            part, target = staging[: end - begin], flat[begin:end]

            def cast(stream: torch.cuda.Stream | None, part: torch.Tensor = part, target: torch.Tensor = target) -> None:
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(flat):
                    target.copy_(part)

            handle = self.store.engine.h2d_then(key, src[begin:end], part, cast, order_after_current=order)
            order = False
            if handle.error is not None:  # not issued: the rest would only follow it into the same failure
                break
        assert handle is not None  # a block has at least one element
        return handle

    def _fetch_staging(self) -> torch.Tensor:
        """The fp32 staging buffer of master fetches, allocated on the copy stream the first time ([Note: fetch
        staging])."""
        if self._staging is None:
            largest = max(state.block.numel for state in self.states)
            with self._copy_stream_context():
                self._staging = torch.empty(min(largest, FETCH_PIECE_NUMEL), dtype=torch.float32, device=self.device)
        return self._staging

    def close(self) -> None:
        """Give the fetch staging back (idempotent): a session kept after ``close()`` holds no device memory for it.
        Its last copies were on the copy stream, where the freed memory goes back."""
        with self._lock:
            self._staging = None

    def _drop_failed_fetch(self, index: int) -> None:
        """A fetch whose copy failed (to issue or on the way): its bytes and their reservation go back."""
        state = self.states[index]
        state.handle = None
        self._free_after_copies(state.flat)
        self._gpu_tier.unreserve(self.nbytes(index))

    def _free_after_copies(self, flat: torch.Tensor) -> None:
        """Give a block's bytes back, after whatever the copy stream queued into them (a fetch that failed part
        way)."""
        stream = self.store.engine.h2d_stream
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        flat.untyped_storage().resize_(0)

    def _copy_stream_context(self) -> contextlib.AbstractContextManager[object]:
        """Work issued inside runs on the copy stream (nothing changes without CUDA)."""
        stream = self.store.engine.h2d_stream
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def is_remote(self, index: int) -> bool:
        """Another rank owns the block: its weights arrive by broadcast, never by a fetch of this process's."""
        return self.ranks is not None and self.owners[index] != self.ranks.rank

    def wait(self, index: int, held: bool = False) -> bool:
        """Make the current stream wait for block index's weights (fetching on demand; a fetch from the master is
        cast on the copy stream before its last event). Returns True when the weights were resident or prefetched (a schedule hit).
        In a run of several processes every rank calls this for the same blocks in the same order, and the owner's
        weights are broadcast to the others each time, whatever each rank holds already ([Note: collectives in
        program order]), unless the block is ``held`` by an earlier acquire of a pass still going on: its weights are
        then on every device since that acquire's broadcast ([Note: held blocks are not broadcast again])."""
        with self._lock:
            if self.ranks is None:
                return self._wait(index)
            gathered = self._gathers.pop(index, None)
            if gathered is not None:  # its broadcast was started ahead (gather_ahead): its end is all there is to wait for
                gathered()
                self.gathered_ahead += 1
                return True
            if held:
                if not self.states[index].resident:  # a release that should not have happened: say so, never compute
                    raise RuntimeError(f"{self.states[index].block.name} is held by a pass on every rank but its "
                                       f"weights left rank {self.ranks.rank}'s device")
                self.held_hits += 1
                return True
            hit = self._ready_to_broadcast(index)
            self.ranks.broadcast(self.states[index].flat, self.owners[index])
            return hit

    def _ready_to_broadcast(self, index: int) -> bool:
        """Several processes: the owner's weights on the device (fetched, the current stream waiting for them), or
        room for them on the other ranks. Returns whether they were there already."""
        assert self.ranks is not None
        state = self.states[index]
        if self.owners[index] == self.ranks.rank:
            return self._wait(index)
        if state.resident:
            return True
        self._gpu_tier.reserve(self.nbytes(index), f"{state.block.name} weights")
        try:
            state.flat.untyped_storage().resize_(self.nbytes(index))
        except BaseException:
            self._gpu_tier.unreserve(self.nbytes(index))
            raise
        state.resident = True
        return False

    def gather_ahead(self, index: int) -> None:
        """Several processes: start block index's broadcast now, so that it overlaps the compute of the block in use;
        its acquire then only waits for it. Every rank calls this at the same point of the same model path (the next
        use the prefetch schedule's trace expects: ``PrefetchSchedule.next_use``). On a GPU the broadcast runs
        after the work queued so far on the compute stream (whose memory the weights may take) and, on the owner, after
        its copy of the weights, but before the compute queued next."""
        assert self.ranks is not None
        with self._lock:
            if index in self._gathers:
                return
            copy_stream = self.store.engine.h2d_stream
            if copy_stream is not None:
                copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with self._copy_stream_context():  # the owner's wait for its copy: on the copy stream, not compute's
                self._ready_to_broadcast(index)
                work = self.ranks.broadcast_async(self.states[index].flat, self.owners[index])
            self._gathers[index] = work.wait  # the current stream waits for it on a GPU (not the host)

    def drop_gathers(self) -> None:
        """The step commits or is dropped: broadcasts started ahead and not used are waited for and their blocks
        released (the weights may change now). Every rank calls this at the same point."""
        with self._lock:
            pending, self._gathers = self._gathers, {}
            for index, wait in pending.items():
                wait()
                self._release(index)

    def _wait(self, index: int) -> bool:
        state = self.states[index]
        if state.resident:
            return True
        hit = state.handle is not None and state.prefetched
        if state.handle is None:
            self._fetch(index, prefetch=False)
        handle = state.handle
        assert handle is not None
        try:
            handle.wait_stream()
        except BaseException:  # the copy failed: the block goes back to holding nothing, the error to the caller
            self._drop_failed_fetch(index)
            raise
        state.handle = None
        state.resident = True
        return hit

    def release(self, index: int) -> None:
        """Free block index's device bytes (its views remain, pointing at zero bytes)."""
        with self._lock:
            self._release(index)

    def _release(self, index: int) -> None:
        state = self.states[index]
        if self.source is WeightSource.RESIDENT or index in self.gpu_updated or state.users > 0 or index in self._gathers:
            return  # (a broadcast started ahead writes into it: its acquire is next)
        if state.handle is not None:  # prefetched but never used: the copy must end before the bytes go
            try:
                state.handle.wait_stream()
            except Exception as error:  # nobody used it: the failed copy costs nothing but its bytes, given back
                log.warning("a prefetch of %s failed and was never used: %r", state.block.name, error)
                self._drop_failed_fetch(index)
                return
            state.handle = None
        if not state.resident and state.flat.untyped_storage().nbytes() == 0:
            return
        if state.flat.is_cuda:
            # No-op when the bytes came from this stream's pool (the usual case, [Note: weights in the compute
            # stream's pool]); a fetch the optimizer worker issued on another stream needs the use recorded.
            state.flat.record_stream(torch.cuda.current_stream(self.device))
        state.flat.untyped_storage().resize_(0)
        state.resident = False
        self._gpu_tier.unreserve(self.nbytes(index))

    def load_resident(self, index: int, master: torch.Tensor | None = None) -> None:
        """Fill a resident block from its master (host copy, or the given device tensor): at start, after a
        checkpoint load, and after each device-side update (stream-ordered on the current stream)."""
        state = self.states[index]
        if master is None:
            key = state.block.key("master")
            self.store.fetch(key, TierName.HOST).wait()  # stages it when the master lives on NVMe
            master = self.store.tensor(key, TierName.HOST)
        if not state.resident:
            self._gpu_tier.reserve(self.nbytes(index), f"{state.block.name} weights")
            try:
                state.flat.untyped_storage().resize_(self.nbytes(index))
            except BaseException:  # the device out of memory: the reservation goes with it
                self._gpu_tier.unreserve(self.nbytes(index))
                raise
            state.resident = True
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(state.flat):
            state.flat.copy_(master.to(self.device, non_blocking=False))

    def fill_from_device(self, index: int, master: torch.Tensor) -> bool:
        """Cast a block's updated device master into its compute weights (stream-ordered on the current stream),
        allocating them if they are not resident: the next forward then needs no fetch and no wait for the
        master's write-back. Returns False, changing nothing, when the block is in use, a fetch is in flight or
        the GPU budget has no room."""
        with self._lock:
            state = self.states[index]
            if state.users > 0 or state.handle is not None:
                return False
            if not state.resident:
                try:
                    self._gpu_tier.reserve(self.nbytes(index), f"{state.block.name} weights")
                except CapacityError:
                    return False
                state.flat.untyped_storage().resize_(self.nbytes(index))
                state.resident = True
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(state.flat):
                state.flat.copy_(master[: state.block.numel])
            return True

    def refresh_resident(self, index: int, staging: torch.Tensor, may_hold: bool = True) -> Handle | None:
        """After an update: H2D the new master into ``staging`` (fp32, device, used only on the copy stream)
        and cast it into the resident weights on the copy stream. The next forward waits on the handle.
        While refreshes are held (``hold_refreshes``) and ``may_hold``, the copy is queued instead and None
        is returned; ``wait_refresh`` or ``release_refreshes`` issues it."""
        with self._lock:
            if may_hold and self._held_refreshes is not None:
                self._held_refreshes[index] = staging
                return None
            return self._issue_refresh(index, staging)

    def hold_refreshes(self) -> None:
        """Queue RESIDENT refreshes from now on instead of issuing them: copies that must land sooner (the
        state of blocks updated on the device during this backward) get the host-to-device link first."""
        with self._lock:
            if self._held_refreshes is None:
                self._held_refreshes = {}

    def release_refreshes(self) -> None:
        """Issue the held refreshes in forward order (the next forward needs the first blocks first) and
        stop holding."""
        with self._lock:
            held, self._held_refreshes = self._held_refreshes or {}, None
            for index in sorted(held):
                self._issue_refresh(index, held[index])

    def is_refresh_held(self, index: int) -> bool:
        """True while block index's refresh is queued behind hold_refreshes()."""
        return self._held_refreshes is not None and index in self._held_refreshes

    def _issue_refresh(self, index: int, staging: torch.Tensor) -> Handle:
        state = self.states[index]
        key = state.block.key("master")
        master = self.store.tensor(key, TierName.HOST)
        view = staging[: state.block.numel]

        def cast(stream: torch.cuda.Stream | None) -> None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(state.flat):
                state.flat.copy_(view)

        handle = self.store.engine.h2d_then(key, master, view, cast, order_after_current=False)
        state.handle = handle
        return handle

    def wait_refresh(self, index: int) -> None:
        """Make the current stream wait for a RESIDENT block's refresh, if one is pending (issuing the held
        ones first when this block's is among them)."""
        with self._lock:
            state = self.states[index]
            if self.is_refresh_held(index):
                self.release_refreshes()
            if state.handle is not None:
                state.handle.wait_stream()
                state.handle = None

    def resident_nbytes(self) -> int:
        """Device bytes held by resident blocks now."""
        return sum(self.nbytes(i) for i, s in enumerate(self.states) if s.resident)
