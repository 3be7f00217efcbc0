"""The store: key -> record of where each copy of a tensor lives, and the movements between tiers.

Every tensor has a home tier (its permanent copy) and may have cached copies on faster tiers. ``fetch``
brings a current copy toward the GPU (staging NVMe -> host on the way), ``evict`` writes a copy back
toward home and drops it, ``release`` drops a copy without writing (refused for the last current copy),
``mark_dirty`` records that a copy was modified in place. All movement goes through the TransferEngine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tierstore.errors import TierStoreError
from tierstore.events import EventBus
from tierstore.keys import TensorKey, TensorMeta
from tierstore.lifecycle import close_at_exit, reclaim_abandoned
from tierstore.nvme import NVMeDirectory
from tierstore.pinned import PinnedArena
from tierstore.residency import CopyState, check_transition
from tierstore.tiers import Allocation, GpuTier, HostTier, NvmeTier, TierName, Tiers
from tierstore.transfer import Handle, TransferEngine, done_handle

log = logging.getLogger(__name__)

TMP_SWAP_PREFIX = "tierstore-nvme-"  # the temporary swap directories of the ``tmp`` path


@dataclass(frozen=True)
class StoreConfig:
    """What the store needs to build its tiers. Sizes are bytes."""

    device: str = "cpu"
    gpu_budget_nbytes: int = 1 << 40
    host_budget_nbytes: int = 1 << 30
    pin: bool | None = None  # None: pin when CUDA is available
    nvme_path: str | None = None  # None: no NVMe tier
    nvme_budget_nbytes: int = 64 << 30
    io_threads: int = 4
    io_block_nbytes: int = 64 << 20
    direct_io: str = "auto"


@dataclass
class Copy:
    """One tier's copy of one tensor."""

    state: CopyState = CopyState.ABSENT
    allocation: Allocation | None = None
    handle: Handle | None = None  # the transfer filling this copy, while LOADING
    settle: Callable[[Handle], None] | None = None  # settles the state once handle completes (idempotent)

    def held(self) -> Allocation:
        """The allocation, which a copy that is current or loading always has."""
        if self.allocation is None:
            raise RuntimeError(f"a {self.state.value} copy holds no allocation")
        return self.allocation


@dataclass
class Record:
    """Everything the store knows of one key."""

    key: TensorKey
    meta: TensorMeta
    home: TierName
    copies: dict[TierName, Copy] = field(default_factory=lambda: {tier: Copy() for tier in TierName})
    step: int = 0  # the step of the newest value; written into swap headers and checked on every read back


class TierStore:
    """Holds tensors across GPU, pinned host and NVMe tiers with hard budgets on each."""

    def __init__(self, config: StoreConfig, bus: EventBus | None = None):
        self.config = config
        self.device = torch.device(config.device)
        # Names this store (one per training session) in what is written on its behalf: a checkpoint records
        # its writer, so a later save of the same session knows which checkpoints it may prune.
        self.instance_id = uuid.uuid4().hex
        self.bus = bus or EventBus()
        self.engine = TransferEngine(self.device, config.io_threads, self.bus)
        self._nvme_tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._records: dict[TensorKey, Record] = {}
        self._lock = threading.RLock()
        self._closed = False
        # A failure part-way (the arena refused, a locked directory, a signal: SIGTERM or Ctrl-C) gives back what
        # was built at once: the engine, the arena, the swap directory (its lock file), the temporary directory (RAM
        # on /dev/shm). The failed store itself lives on in the exception's traceback, so this cannot wait for its
        # collection.
        with contextlib.ExitStack() as undo:
            undo.callback(self.engine.close)
            gpu = GpuTier(self.device, config.gpu_budget_nbytes)
            host = HostTier(PinnedArena(config.host_budget_nbytes, config.pin))
            undo.callback(host.close)
            nvme: NvmeTier | None = None
            if config.nvme_path is not None:
                path = config.nvme_path
                if path == "tmp":
                    root = swap_tmp_root()
                    reclaim_abandoned(root, TMP_SWAP_PREFIX)  # on /dev/shm a killed run's files hold RAM until reboot
                    self._nvme_tmpdir = tempfile.TemporaryDirectory(prefix=TMP_SWAP_PREFIX, dir=root)
                    undo.callback(self._nvme_tmpdir.cleanup)
                    path = self._nvme_tmpdir.name
                nvme = NvmeTier(NVMeDirectory(path, config.nvme_budget_nbytes, config.direct_io, config.io_block_nbytes))
                undo.callback(nvme.close)
            self.tiers = Tiers(gpu, host, nvme)
            # Registered before the undo is let go: a signal between the two left a store that nothing closed (the
            # caller never got it), its lock file and tmp directory with it. Undone after all, the store counts as
            # closed, and the exit hook does nothing.
            undo.callback(setattr, self, "_closed", True)
            close_at_exit(self, TierStore.close)  # a program that never calls close() still leaves no swap files
            undo.pop_all()

    # ---- registry ------------------------------------------------------------------------------------
    def register(self, key: TensorKey | str, meta: TensorMeta, home: TierName | str, init: torch.Tensor | None = None,
                 *, step: int = 0) -> Record:
        """Reserve key's home copy. ``init`` (any tensor of meta's dtype and numel) is written into it;
        without it the home copy is zero-filled on every tier (arena memory is reused, so never assume it).
        ``step``: the step of that value (what an NVMe home's header records, and every read back expects)."""
        key, home = _key(key), TierName(home)
        if home not in self.tiers:
            raise TierStoreError(f"cannot place {key} on {home.value}: that tier is not configured (set tiers.nvme.path)")
        if init is not None and (init.numel() != meta.numel or init.dtype != meta.dtype):
            raise ValueError(f"init for {key} is {init.dtype} x{init.numel()}, expected {meta.dtype} x{meta.numel}")
        with self._lock:
            if key in self._records:
                raise KeyError(f"{key} is already registered")
            record = Record(key=key, meta=meta, home=home, step=step)
            home_copy = record.copies[home]
            home_copy.allocation = allocation = self.tiers[home].allocate(key, meta)
            self._records[key] = record
        try:
            if init is None:
                if home is TierName.NVME:
                    self._write_zeros(record)
                else:
                    allocation.require_tensor().zero_()
            elif home is TierName.NVME:
                self._write_home_nvme(record, init.reshape(-1))
            else:
                allocation.require_tensor().copy_(init.reshape(-1))
        except BaseException:
            self.unregister(key)  # nothing half-registered: the home reservation (and its file) goes too
            raise
        home_copy.state = CopyState.CLEAN
        return record

    def unregister(self, key: TensorKey | str) -> None:
        """Drop every copy of key and return its bytes (waiting for transfers in flight)."""
        with self._lock:
            record = self._records.pop(_key(key))
        for copy in record.copies.values():  # every transfer and its callbacks first, then free once
            handle = copy.handle
            if handle is not None:
                handle._wait_complete()
        with self._lock:
            for tier, copy in record.copies.items():
                if copy.allocation is not None:
                    self.tiers[tier].free(copy.allocation)
                    copy.allocation = None

    def move_home(self, key: TensorKey | str, to: TierName | str) -> Record:
        """Make tier ``to`` key's home: its current value is written there and every other copy is dropped. For
        between uses (no copy of key may be in use); the value and the record's step are kept. When ``to`` has
        no room (CapacityError) key stays where it was, unchanged."""
        record, to = self.record(key), TierName(to)
        if record.home is to:
            return record
        current = next((t for t in (TierName.GPU, TierName.HOST) if self.state(record.key, t).is_current), None)
        if current is None:  # only on NVMe: staged through host, as a fetch would
            self.fetch(record.key, TierName.HOST).wait()
            current = TierName.HOST
        # The value waits in ordinary host memory: a move off the GPU (a rollback) may be for want of device room.
        value, step = self.tensor(record.key, current).to("cpu", copy=True), record.step
        self.unregister(record.key)
        try:
            return self.register(record.key, record.meta, to, init=value, step=step)
        except BaseException:
            self.register(record.key, record.meta, record.home, init=value, step=step)
            raise

    def record(self, key: TensorKey | str) -> Record:
        """The record of key."""
        return self._records[_key(key)]

    def has(self, key: TensorKey | str) -> bool:
        """True when key is registered."""
        return _key(key) in self._records

    def keys(self) -> list[TensorKey]:
        """Every registered key."""
        return list(self._records)

    def state(self, key: TensorKey | str, tier: TierName | str) -> CopyState:
        """The state of key's copy on tier (settling a completed transfer first)."""
        copy = self.record(key).copies[TierName(tier)]
        self._settle(copy)
        return copy.state

    def tensor(self, key: TensorKey | str, tier: TierName | str) -> torch.Tensor:
        """A flat view of key's current copy on tier (GPU or host). Waits for a transfer filling it."""
        record, tier = self.record(key), TierName(tier)
        copy = record.copies[tier]
        handle = copy.handle
        if handle is not None:
            handle.wait()
            self._settle(copy)
        if not copy.state.is_current or copy.allocation is None or copy.allocation.tensor is None:
            raise RuntimeError(f"{record.key} has no current copy on {tier.value} (state {copy.state.value}); fetch it first")
        return copy.allocation.tensor

    def snapshot(self, key: TensorKey | str) -> torch.Tensor:
        """A new flat CPU tensor holding key's current value, its copies left as they are (nothing staged, moved or
        released): for a thread that reads key while another may move it (a rank's read service, runtime.model.
        remote_reads). From the host copy where it is current (copied under the store's lock, so that no release
        frees it meanwhile), else from the GPU copy (on the caller's current stream: the caller makes sure what wrote
        it has run), else from the NVMe file once no write of it is in flight. Waits for a transfer filling a copy."""
        record = self.record(key)
        out = torch.empty(record.meta.numel, dtype=record.meta.dtype)
        while True:
            self.wait_written(key)  # an NVMe home's file is whole before it is read
            with self._lock:
                loading = None
                for tier in (TierName.HOST, TierName.GPU, TierName.NVME):
                    copy = record.copies[tier]
                    self._settle(copy)
                    if copy.state is CopyState.LOADING:
                        loading = copy.handle
                    elif copy.state.is_current and tier is not TierName.NVME:
                        out.copy_(copy.held().require_tensor())
                        return out
                    elif copy.state.is_current and loading is None:
                        self._nvme_dir.read(copy.held().require_swap(), out.view(torch.uint8),
                                            expected_step=record.step)
                        return out
            if loading is None:
                raise RuntimeError(f"{record.key} has no current copy to read")
            loading._wait_complete()  # a copy on its way (outside the lock: its callbacks take it), then again

    # ---- movement ------------------------------------------------------------------------------------
    def fetch(self, key: TensorKey | str, to: TierName | str = TierName.GPU) -> Handle:
        """Bring a current copy of key to tier ``to`` (staging through host when it only lives on NVMe).
        Returns a handle; a copy already there (or on its way) returns its handle at once."""
        record, to = self.record(key), TierName(to)
        if to is TierName.NVME:
            raise ValueError("fetch moves toward the GPU; use evict to write to NVMe")
        with self._lock:
            target = record.copies[to]
            self._settle(target)
            if target.state is CopyState.LOADING:
                if target.handle is None:  # _copy sets both under the lock; settle clears both
                    raise RuntimeError(f"{record.key} on {to.value} is loading with no transfer in flight")
                return target.handle
            if target.state.is_current:
                return done_handle(str(record.key), to.value)
            source_tier = self._nearest_current(record, below=to)
            after: Handle | None = None
            if source_tier is TierName.NVME and to is TierName.GPU:
                after = self.fetch(record.key, TierName.HOST)  # stage; the host copy stays as a cache
                source_tier = TierName.HOST
                if record.copies[TierName.HOST].allocation is None:  # the staging read failed at once
                    return after  # its wait() raises the read's error; the GPU copy was never touched
            dirty = not record.copies[record.home].state.is_current
            return self._copy(record, source_tier, to, after, dirty)

    prefetch = fetch  # a fetch issued early by the schedule; same mechanics, named for the reader

    def evict(self, key: TensorKey | str, frm: TierName | str, to: TierName | str | None = None, release: bool = True,
              background: bool = False) -> Handle:
        """Write key's copy on ``frm`` back to ``to`` (default: home) and, when ``release``, drop ``frm``'s copy
        once the write completes. A clean copy is simply released. ``background``: nothing waits for this
        write soon; a GPU -> host copy is then paced so that it never holds up other device-to-host copies
        (see ``tierstore.transfer._Pacer``)."""
        record = self.record(key)
        frm = TierName(frm)
        to = record.home if to is None else TierName(to)
        if to.rank <= frm.rank:
            raise ValueError(f"evict moves away from the GPU: {frm.value} -> {to.value} is not toward a lower tier")
        if (frm, to) == (TierName.GPU, TierName.NVME):
            raise TierStoreError(f"{record.key}: GPU -> NVMe goes through host; evict to host first")
        handle = record.copies[frm].handle
        if handle is not None:
            handle._wait_complete()  # outside the lock: the transfer's callbacks take it
        with self._lock:
            source = record.copies[frm]
            self._settle(source)
            if source.state is CopyState.LOADING:
                raise RuntimeError(f"{record.key} on {frm.value} is loading again; wait for its handle first")
            if not source.state.is_current:
                raise RuntimeError(f"{record.key} on {frm.value} is {source.state.value}: nothing to evict")
            if record.copies[to].state.is_current:
                if release:
                    self.release(record.key, frm)
                return done_handle(str(record.key), to.value)
            return self._copy(record, frm, to, None, dirty=to is not record.home, paced=background,
                              release_source=release)

    def wait_written(self, key: TensorKey | str) -> None:
        """Wait until no write of key to its NVMe home is in flight (an ``evict``) and what follows it (the release
        of the copy it wrote from) has run: a copy about to be modified in place must not be one that a write
        is still reading or is about to free. No-op for other homes."""
        record = self.record(key)
        if record.home is TierName.NVME:
            handle = record.copies[TierName.NVME].handle
            if handle is not None:
                handle._wait_complete()  # never raises: a failed write surfaces through its own handle

    def release_read_ahead(self, key: TensorKey | str, tier: TierName | str) -> None:
        """Release key's copy on tier if it has one, once a transfer still filling it has landed: a copy read ahead
        for work that will not run (a dropped step, a skipped update). Key's last write to its NVMe home goes first
        (``wait_written``): until it has released the copy it wrote from, that copy is the only current one (an
        fp16 overflow's skipped update right after an update). ``release``'s refusals apply."""
        self.wait_written(key)
        handle = self.record(key).copies[TierName(tier)].handle
        if handle is not None:
            handle.wait()
        self.release(key, tier)

    def release(self, key: TensorKey | str, tier: TierName | str) -> None:
        """Drop key's copy on tier without writing it anywhere. Refused for the home copy and for the last
        current copy (evict it instead)."""
        record, tier = self.record(key), TierName(tier)
        with self._lock:
            copy = record.copies[tier]
            self._settle(copy)
            if copy.state is CopyState.ABSENT:
                return
            if tier is record.home:
                raise RuntimeError(f"{record.key}: the home copy on {tier.value} cannot be released")
            if copy.state is CopyState.LOADING:
                raise RuntimeError(f"{record.key} on {tier.value} is still loading; wait for its handle first")
            if copy.state is CopyState.DIRTY and not any(
                c.state.is_current for t, c in record.copies.items() if t is not tier
            ):
                raise RuntimeError(f"{record.key} on {tier.value} is the only current copy; evict it instead of releasing")
            allocation = copy.held()
            self._set_state(record, tier, CopyState.ABSENT)
            self.tiers[tier].free(allocation)
            copy.allocation = None

    def mark_dirty(self, key: TensorKey | str, tier: TierName | str, step: int | None = None) -> None:
        """Record that key's copy on tier was modified in place; every other copy becomes stale."""
        record, tier = self.record(key), TierName(tier)
        with self._lock:
            copy = record.copies[tier]
            self._settle(copy)
            if not copy.state.is_current:
                raise RuntimeError(f"{record.key} on {tier.value} is {copy.state.value}; only a current copy can be modified")
            for other_tier, other in record.copies.items():
                if other_tier is not tier and other.state.is_current:
                    self._set_state(record, other_tier, CopyState.STALE)
            self._set_state(record, tier, CopyState.CLEAN if tier is record.home else CopyState.DIRTY)
            if step is not None:
                record.step = step

    # ---- second host buffers (values written out of place, published at once) ---------------------------
    def allocate_spare(self, key: TensorKey | str) -> Allocation:
        """A host buffer the size of key's, from the host budget (CapacityError when it has no room), outside
        key's copies: a new value can be written there while the host copy keeps the old one, then made the
        host copy by ``exchange_host``. Give it back with ``free_spare``."""
        record = self.record(key)
        with self._lock:
            return self.tiers[TierName.HOST].allocate(record.key, record.meta)

    def free_spare(self, spare: Allocation) -> None:
        """Return a buffer from ``allocate_spare`` (or one ``exchange_host`` handed back)."""
        with self._lock:
            self.tiers[TierName.HOST].free(spare)

    def exchange_host(self, key: TensorKey | str, spare: Allocation, step: int | None = None) -> Allocation:
        """Make ``spare`` (filled with key's new value) key's host copy, modified in place as ``mark_dirty`` records
        it, and return the buffer it replaces (the old value) as the new spare. Key's host copy must be current
        with no transfer in flight: the swap is two pointers, so nothing may be reading or filling either."""
        record = self.record(key)
        with self._lock:
            copy = record.copies[TierName.HOST]
            self._settle(copy)
            if not copy.state.is_current or copy.handle is not None or copy.allocation is None:
                raise RuntimeError(f"{record.key}: the host copy is {copy.state.value}; only a current host copy "
                                   "with no transfer in flight can be exchanged")
            if spare.meta != record.meta or spare.tensor is None:
                raise RuntimeError(f"{record.key}: a spare of {spare.meta} can't replace a host copy of {record.meta}")
            old, copy.allocation = copy.allocation, spare
            self.mark_dirty(record.key, TierName.HOST, step=step)
            return old

    # ---- internals -----------------------------------------------------------------------------------
    def _copy(self, record: Record, frm: TierName, to: TierName, after: Handle | None, dirty: bool,
              paced: bool = False, release_source: bool = False) -> Handle:
        """Reserve ``to``'s copy (if needed), issue the transfer, and settle the state when it completes;
        ``release_source``: then drop ``frm``'s copy too (an eviction), in the same step."""
        target = record.copies[to]
        if target.allocation is None:
            target.allocation = self.tiers[to].allocate(record.key, record.meta)
        self._set_state(record, to, CopyState.LOADING)
        name = str(record.key)
        src, dst = record.copies[frm].held(), target.allocation
        host = self.tiers.host
        if (frm, to) == (TierName.HOST, TierName.GPU):
            handle = self.engine.h2d(name, src.require_tensor(), dst.require_tensor(), after)
        elif (frm, to) == (TierName.GPU, TierName.HOST):
            handle = self.engine.d2h(name, src.require_tensor(), dst.require_tensor(), after, paced=paced)
        elif (frm, to) == (TierName.NVME, TierName.HOST):
            # The file must hold the step the store last wrote there: a rolled-back file reads as corrupt.
            handle = self.engine.read(name, self._nvme_dir, src.require_swap(), host.io_buffer(dst), record.step)
        elif (frm, to) == (TierName.HOST, TierName.NVME):
            handle = self.engine.write(name, self._nvme_dir, dst.require_swap(), host.io_buffer(src), record.step, after)
        elif (frm, to) == (TierName.GPU, TierName.NVME):
            raise TierStoreError(f"{record.key}: GPU -> NVMe goes through host; evict to host first")
        else:
            raise RuntimeError(f"no path {frm.value} -> {to.value}")
        final = CopyState.DIRTY if dirty else CopyState.CLEAN
        source_copy = record.copies[frm]

        def settle(h: Handle) -> None:
            with self._lock:
                if target.handle is not h:
                    return
                try:
                    if h.error is not None:
                        self._set_state(record, to, CopyState.ABSENT if to is not record.home else CopyState.STALE)
                        if to is not record.home and target.allocation is not None:
                            self.tiers[to].free(target.allocation)
                            target.allocation = None
                        return
                    self._set_state(record, to, final)
                    if to is record.home and source_copy.state is CopyState.DIRTY:
                        self._set_state(record, frm, CopyState.CLEAN)
                    if release_source:
                        self._release_after_evict(record, frm)
                finally:
                    # Cleared last, under the lock: whoever sees no transfer in flight (wait_written) sees all of its
                    # outcome, the eviction's release included. Released in a later callback, a caller could find
                    # the write done, modify the copy it wrote from, and have that copy freed after it: lost.
                    target.handle = None

        target.settle = settle
        target.handle = handle
        handle.add_done_callback(settle)
        return handle

    def _release_after_evict(self, record: Record, tier: TierName) -> None:
        with self._lock:
            copy = record.copies[tier]
            if copy.allocation is not None and copy.state is not CopyState.LOADING and tier is not record.home:
                self._set_state(record, tier, CopyState.ABSENT)
                self.tiers[tier].free(copy.allocation)
                copy.allocation = None

    def _settle(self, copy: Copy) -> None:
        handle, settle = copy.handle, copy.settle
        if handle is not None and settle is not None and handle.done():  # done() runs settle unless another thread is
            settle(handle)  # no-op when that callback already ran

    def _wait_settled(self, copy: Copy) -> None:
        """Wait for the transfer filling copy and settle its state here; for callers holding the lock."""
        handle, settle = copy.handle, copy.settle
        if handle is not None and settle is not None:  # _copy sets both before anyone can see the handle
            handle._wait_complete(callbacks=False)  # the settle callback may be blocked on our lock
            settle(handle)

    def _nearest_current(self, record: Record, below: TierName) -> TierName:
        for tier in TierName:
            if tier.rank > below.rank:
                copy = record.copies[tier]
                self._wait_settled(copy)
                if copy.state.is_current:
                    return tier
        raise RuntimeError(f"{record.key} has no current copy below {below.value}")

    def _set_state(self, record: Record, tier: TierName, new: CopyState) -> None:
        copy = record.copies[tier]
        check_transition(str(record.key), tier.value, copy.state, new)
        copy.state = new

    @property
    def _nvme_dir(self) -> NVMeDirectory:
        if self.tiers.nvme is None:
            raise TierStoreError("no NVMe tier is configured (set tiers.nvme.path)")
        return self.tiers.nvme.directory

    def _write_home_nvme(self, record: Record, data: torch.Tensor) -> None:
        """Write initial data to an NVMe home through a temporary host staging buffer."""
        host = self.tiers.host
        staging = host.allocate(record.key, record.meta)
        try:
            staging.require_tensor().copy_(data)
            swap = record.copies[TierName.NVME].held().require_swap()
            self.engine.write(str(record.key), self._nvme_dir, swap, host.io_buffer(staging), record.step).wait()
        finally:
            host.free(staging)

    def _write_zeros(self, record: Record) -> None:
        """A new NVMe home reads as zeros already (preallocated): only its header is written."""
        self._nvme_dir.write_zeros(record.copies[TierName.NVME].held().require_swap(), record.step)

    # ---- accounting & lifetime -----------------------------------------------------------------------
    def usage(self) -> dict[str, dict[str, int]]:
        """Bytes used and budget per tier."""
        return {name.value: {"used_nbytes": t.used_nbytes, "capacity_nbytes": t.capacity_nbytes} for name, t in self.tiers.items()}

    @property
    def nvme_io_mode(self) -> str | None:
        """"direct" or "buffered" when an NVMe tier exists."""
        return self.tiers.nvme.directory.io_mode if self.tiers.nvme is not None else None

    @property
    def closed(self) -> bool:
        """True once close() has run: every buffer is back with its tier."""
        return self._closed

    def close(self) -> None:
        """Finish transfers, free everything, delete swap files and unlock the NVMe directory."""
        if self._closed:
            return
        self._closed = True
        # The tiers close (swap files deleted, lock released) even when a transfer failed: callbacks run in
        # reverse, the temporary directory last; the first error is raised after all of them ran.
        with contextlib.ExitStack() as stack:
            if self._nvme_tmpdir is not None:
                stack.callback(self._nvme_tmpdir.cleanup)
            for tier in self.tiers.values():
                stack.callback(tier.close)
            self.engine.close()
            for key in list(self._records):
                self.unregister(key)

    def __enter__(self) -> TierStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _key(key: TensorKey | str) -> TensorKey:
    return key if isinstance(key, TensorKey) else TensorKey(key)


def swap_tmp_root() -> str:
    """Where the ``tmp`` swap path puts its directory: tmpfs (/dev/shm) when present, so temporary swap
    directories exercise the buffered path fast (and use RAM: the plan counts them as such), else the
    system temp directory."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir()
