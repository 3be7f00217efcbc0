"""Gradient accumulation in pinned host memory, for models whose summed gradients do not fit the GPU.

With ``optimizer.accumulate_on: host`` the gradient of a micro-batch that does not end the step leaves the device
as soon as its block's backward is done, in the host gradient dtype (``optimizer.host_grad_dtype``: bf16 under bf16
by default, else fp32), and a CPU thread adds it to the block's host gradient buffer,
the buffer the optimizer reads at the step. The GPU then holds one block's
gradient at a time instead of the whole model's (16 GB of bf16 for an 8B model). The step's last micro-batch is
summed on the device: the controller brings the host sum in, adds it, and sends the total through the usual
offload (norms, clipping, unscaling).

[Note: host gradient sums]
The sums run in micro-batch order, ((g1 + g2) + g3) + ..., in the host gradient dtype: what a plain loop's ``.grad``
holds, bit for bit, for fp32 parameters (fp32 sums) and for bf16 ones (bf16 sums, each add rounded, as autograd
accumulates a bf16 ``.grad``; the CPU widens the total to fp32 for the clip and AdamW, exactly). fp32 sums under
bf16 (``host_grad_dtype: fp32``) are finer than the plain loop's and take twice the pinned memory: in the 8B
scenario 13.6 GiB more once the embedding and layer 0 update on the GPU (15.0 in the all-CPU first step); with them
12 blocks' moments stayed on disk, with bf16 sums none (call G3, an H200). A parameter without a gradient in some
micro-batch adds zero there (exact, but for the sign of a zero), and it is updated at the step when any micro-batch
of the step gave it a gradient.
Between micro-batches the parameter's ``.grad`` is an ``OffloadedGrad`` standing for the host sum (runtime.engine.clipping):
``model.zero_grad()`` (either form) drops it, as plain PyTorch drops its ``.grad``; its 2-norm and a multiply by one number
(``clip_grad_norm_``, the HF Trainer's clip before a short last step) are served from and applied to the host sum;
reading its values raises. The copies off the device go through a
few pinned staging buffers (``STAGING_SLOTS`` of ``PIECE_NUMEL`` elements; a block's gradient travels in
pieces, each made from the parameters' gradients once a buffer is free for it, so the GPU never holds a second
copy of a block's gradient: 2 GiB of fp32 for the 8B scenario's head): the backward waits for a free one only
when the CPU sums fall behind, which bounds the pinned memory
(1 GiB of fp32 sums, 512 MiB of bf16 ones, not a multiple of a 128k-vocabulary embedding) and paces the backward to the host's summing rate.
A piece holds its buffer from the moment the backward queues its copy, while the GPU may still be computing
it, so the backward's wait for a buffer is the training thread running ahead of the GPU as much as the GPU
idling: twelve buffers cut that wait from 16-17 s to 3.6 s a step of the 8B scenario but not its
micro-batches (41.8 s against 40.7 with four), and their 2 GiB more pinned memory spilled two more blocks'
moments to disk (59 s steady steps against 56; H200, 2026-11-26). With fp32 sums, fp32
crosses PCIe rather than bf16 because the host adds fp32 to fp32 fastest: on the H100 box, 10.8 G elements/s
against 6.9-8.4 for a bf16 gradient widened piece by piece (a mixed-dtype ``add_`` is 10x slower still), while
the device-to-host copy, otherwise idle during accumulation, carries 13 G fp32 elements/s. bf16 across would move
4 bytes less of host memory a parameter and micro-batch (2 written by the copy, 2 read by the sum), and host memory
is what the 8B scenario's copies and sums share (see [Note: fetch staging]); tried with the widening done through a
16 MiB scratch that stays in cache (call Q3, an H100, the 8B width at 16 layers, same machine): exact, but steady
steps of 22.5 / 22.5 s against 22.8 / 20.8 with fp32, the CPU summing 11.5-11.9 s a step against 7.9-11.0.
Copying a step's first micro-batch straight into the pinned sum (no staging, no CPU copy) was exact and no faster
either (call R2, same shape: 21.4 / 20.6 s against 20.8 / 20.3; CPU summing 6.6-7.0 s against 6.8-7.3).

What it leaves out: when a block's gradient is done and the last micro-batch's device-side sum
(``runtime.engine.controller``), the update itself (``runtime.update.worker``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.core.blocks import Block
from runtime.planning.buffers import PIECE_NUMEL, STAGING_SLOTS
from tierstore import Handle, TensorMeta, TierName, TierStore

log = logging.getLogger(__name__)

_STAGING_KEY = "grad_sum_staging.{}"


@dataclass
class _Pending:
    """A piece of one micro-batch's block gradient on its way into the block's host sum."""

    block: Block
    handle: Handle  # the copy filling the staging buffer
    slot: int
    first: bool  # the step's first micro-batch for this block: the sum starts from it
    begin: int  # the piece's elements in the block's flat gradient
    end: int


@dataclass
class SumStats:
    """What the host sums cost: seconds the CPU thread spent adding, seconds the backward waited for a staging
    buffer, and the gradient bytes that left the device."""

    sum_s: float = 0.0
    staging_wait_s: float = 0.0
    nbytes: int = 0


class HostGradSums:
    """Sums micro-batch gradients of the given blocks in their host gradient buffers, on one CPU thread."""

    def __init__(self, store: TierStore, blocks: list[Block], *, dtype: torch.dtype = torch.float32,
                 slots: int | None = None):
        self.store = store
        self.dtype = dtype  # of the sums and of what crosses to them (optimizer.host_grad_dtype)
        self.blocks = {block.index: block for block in blocks}
        self.piece_numel = max(1, min(PIECE_NUMEL, max((block.numel for block in blocks), default=1)))
        slots = STAGING_SLOTS if slots is None else slots  # read at construction: tests lower it
        self._staging = [_STAGING_KEY.format(i) for i in range(slots)]
        for key in self._staging:
            store.register(key, TensorMeta(dtype, self.piece_numel), TierName.HOST)
        self._cond = threading.Condition()
        self._free = list(range(slots))
        self._queue: deque[_Pending] = deque()
        self._sent = {index: 0 for index in self.blocks}  # pieces sent this step (training thread)
        self._landed = {index: 0 for index in self.blocks}  # of those, summed (this thread)
        self._had_grad: dict[int, list[bool]] = {}  # per block: parameters with a gradient in a sent micro-batch
        self._error: BaseException | None = None
        self._stopping = False
        self.stats = SumStats()
        self._thread = threading.Thread(target=self._run, name="tierstore-gradsum", daemon=True)
        self._thread.start()

    def holds(self, index: int) -> bool:
        """True when block index's gradients are summed on the host."""
        return index in self.blocks

    def add(self, block: Block, grad: torch.Tensor, has_grad: list[bool]) -> float:
        """Send one micro-batch's flat gradient of block (on the device, in the sums' dtype, zeros where ``has_grad``
        is False) to its host sum. Returns once the copies are queued (grad's memory is kept until they end), with
        the seconds it waited for a free staging buffer."""
        if grad.dtype != self.dtype or grad.numel() != block.numel:
            raise ValueError(f"{block.name}: a host sum takes the block's flat {_name(self.dtype)} gradient, got "
                             f"{_name(grad.dtype)} x{grad.numel()}")
        return self.add_pieces(block, lambda begin, end: grad[begin:end], has_grad)

    def add_pieces(self, block: Block, piece: Callable[[int, int], torch.Tensor], has_grad: list[bool]) -> float:
        """:meth:`add`, with the flat gradient made a piece at a time: ``piece(begin, end)`` gives its elements
        ``[begin, end)`` on the device, called once a staging buffer is free for them. The GPU then holds the
        pieces whose copies are queued instead of the block's whole gradient (2 GiB of fp32 for a 128k
        vocabulary's head under the 8B scenario's 24 GiB cap). Returns the seconds it waited for a free staging
        buffer."""
        self._raise_if_failed()
        index = block.index
        previous = self._had_grad.get(index)
        self._had_grad[index] = has_grad if previous is None else [a or b for a, b in zip(previous, has_grad, strict=False)]
        first = self._sent[index] == 0
        waited = 0.0
        for begin in range(0, block.numel, self.piece_numel):
            end = min(block.numel, begin + self.piece_numel)
            slot, seconds = self._free_slot()
            waited += seconds
            try:
                source = piece(begin, end)
                if source.dtype != self.dtype or source.numel() != end - begin:
                    raise ValueError(f"{block.name}: piece [{begin}, {end}) of a host sum must be {end - begin} "
                                     f"{_name(self.dtype)} elements, got {_name(source.dtype)} x{source.numel()}")
                staging = self.store.tensor(self._staging[slot], TierName.HOST)[: end - begin]
                with torch.profiler.record_function("tierstore.grad_to_host_sum"):
                    handle = self.store.engine.d2h(block.key("grad"), source, staging)
            except BaseException:
                with self._cond:  # the buffer was never handed to a copy: give it back
                    self._free.append(slot)
                    self._cond.notify_all()
                raise
            self.stats.nbytes += (end - begin) * source.element_size()
            with self._cond:
                self._sent[index] += 1
                self._queue.append(_Pending(block, handle, slot, first, begin, end))
                self._cond.notify_all()
        return waited

    def _free_slot(self) -> tuple[int, float]:
        """A staging buffer no sum is using (waits for one), and the seconds waited (0 when one was free)."""
        with self._cond:
            if self._free:
                return self._free.pop(), 0.0
            start = time.perf_counter()
            while not self._free and self._error is None and not self._stopping:
                self._cond.wait(1.0)
            self._raise_if_failed()
            if not self._free:
                raise RuntimeError("the host gradient sums were closed while a gradient was being sent")
            slot = self._free.pop()
        waited = time.perf_counter() - start
        self.stats.staging_wait_s += waited
        return slot, waited

    def release(self, index: int) -> None:
        """Block index's gradients are summed here no more (its update moved to the GPU between steps:
        ``Controller.adopt_placement``); nothing of it may be in flight. Its host gradient buffer is the caller's."""
        with self._cond:
            if self._sent.get(index, 0) or self._landed.get(index, 0):
                raise RuntimeError(f"block {index}'s gradient is being summed on the host; release it between steps")
            self.blocks.pop(index, None)
            self._sent.pop(index, None)
            self._landed.pop(index, None)
        self._had_grad.pop(index, None)

    def has_grad(self, index: int, position: int) -> bool:
        """Whether parameter ``position`` of block index got a gradient in a micro-batch sent this step."""
        had_grad = self._had_grad.get(index)
        return had_grad is not None and had_grad[position]

    def drop(self, index: int, position: int) -> None:
        """``p.grad = None`` between micro-batches for parameter ``position`` of block index: as plain PyTorch drops
        the gradient summed so far, zero that parameter's part of the host sum (once the pieces in flight have
        landed) and forget that it had one; a later micro-batch's gradient then starts it afresh (0 + g = g)."""
        if index not in self.blocks:
            return
        self.wait_landed(index)
        had_grad = self._had_grad.get(index)
        if not self._sent[index] or had_grad is None or not had_grad[position]:
            return
        slot = self.blocks[index].slots[position]
        self.store.tensor(self.blocks[index].key("grad"), TierName.HOST)[slot.offset : slot.offset + slot.numel].zero_()
        had_grad[position] = False

    def finish(self, index: int) -> list[bool] | None:
        """Wait until every micro-batch sent for block index is in its host sum and start the next step's sum.
        Returns which parameters got a gradient in those micro-batches, or None when none was sent."""
        self.wait_landed(index)
        had_grad = self._had_grad.pop(index, None)
        self._sent[index] = self._landed[index] = 0
        return had_grad

    def wait_landed(self, index: int) -> None:
        """Wait until every piece sent for block index is in its host sum (a failed sum raises)."""
        with self._cond:
            while self._landed[index] < self._sent[index] and self._error is None and not self._stopping:
                self._cond.wait(1.0)
        self._raise_if_failed()

    def reset(self) -> None:
        """Drop the step's sums (a discarded step): wait for sums in flight, then the next step starts afresh."""
        with self._cond:
            while self._queue and self._error is None:
                self._cond.wait(0.1)
            for index in self._sent:
                self._sent[index] = self._landed[index] = 0
        self._had_grad.clear()

    def close(self) -> None:
        """Finish the sums in flight, stop the thread and give the staging buffers back (idempotent)."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        with self._cond:  # a failed thread left pieces queued: their copies may still write into the buffers
            left, self._queue = list(self._queue), deque()
        for pending in left:
            pending.handle._wait_complete()
        if not self.store.closed:
            for key in self._staging:
                self.store.unregister(key)

    # ---- the thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                pending = self._queue[0]
            try:
                self._sum(pending)
            except BaseException as exc:  # surfaced to the training thread at its next add / finish
                log.exception("summing %s's gradient on the host failed", pending.block.name)
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._queue.popleft()
                self._free.append(pending.slot)
                self._landed[pending.block.index] += 1
                self._cond.notify_all()

    def _sum(self, pending: _Pending) -> None:
        pending.handle.wait()
        start = time.perf_counter()
        numel = pending.end - pending.begin
        total = self.store.tensor(pending.block.key("grad"), TierName.HOST)[pending.begin : pending.end]
        grad = self.store.tensor(self._staging[pending.slot], TierName.HOST)[:numel]
        with torch.profiler.record_function("tierstore.host_grad_sum"):
            if pending.first:
                total.copy_(grad)
            else:
                total.add_(grad)
        self.stats.sum_s += time.perf_counter() - start

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"summing gradients on the host failed: {self._error!r}") from self._error


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
