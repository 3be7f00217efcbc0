"""Streamed state on its way back to host memory after a device update, and the forward that waits for it.

One job: track the write-backs of streamed blocks' master and moments (``runtime.update.device_updates`` starts
them), and the copies to host of gradients held on the device until the commit ([Note: held gradients] in
``runtime.engine.held_grads``), and keep the next forward within device memory while they are in flight. What it leaves out: which
blocks stream (the controller's placement) and when their state comes in (``runtime.update.device_updates``), how
copies are issued (``tierstore.transfer``).

[Note: paced write-back]
A streamed block's state is written back after its update, at ``optimizer.step()`` under clipping or fp16
(the update waits for the whole gradient). The copies are paced (``TierStore.evict(background=True)``): the
copy engine serves device->host copies in queue order, so several GB queued at once would hold the user's
``loss.item()`` and with it the launch of the next forward. Paced, the next forward runs while the state
goes home, and the state's device memory comes back piece by piece. Under a capped GPU that memory may be
what the forward's activations need: ``before_forward`` waits on the host for the oldest write-backs when the
block about to run would take the allocations past the allocator's limit (the growth each block's forward
showed last time, the limit less a margin for fragmentation), and ``forward_end`` waits for the rest before
the backward (which streams the next state into the memory it frees). Without such a wait the caching allocator
would free its whole cache and synchronize the device to satisfy the request, or raise out of memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from runtime.planning.buffers import allocator_limit_nbytes
from tierstore import Handle

log = logging.getLogger(__name__)

FRAGMENTATION_MARGIN = 0.03  # share of the allocator's limit kept free of write-backs for fragmentation


class DeviceWritebacks:
    """Write-backs of streamed state in flight, and each block's forward memory growth (see the Note)."""

    def __init__(self, device: torch.device, limit_nbytes: int | None = None,
                 allocated: Callable[[], int] | None = None):
        """``limit_nbytes`` / ``allocated``: the allocator's limit and its bytes in use now (default: read from
        CUDA; no pacing of the forward off CUDA)."""
        self.device = device
        self.handles: list[Handle] = []
        self._limit_arg = limit_nbytes
        self._limit: int | None = None
        self._limit_known = False  # read at the first forward that may wait: a session streaming nothing never asks
        self._allocated = allocated or (lambda: torch.cuda.memory_allocated(device))
        # (position in the forward, block) -> bytes allocated from its start to the next block's, the last time.
        # Keyed by position too: a block used twice (tied embedding and head) grows differently each time.
        self._growth: dict[tuple[int, int], int] = {}
        self._marks: list[tuple[int, int]] = []  # this forward: (block, bytes allocated less write-backs held)
        self._kept: dict[Handle, torch.Tensor] = {}  # write-backs' source tensors kept alive until seen complete
        self.waits = 0  # forwards that waited for a write-back to make room
        self.wait_s = 0.0

    @property
    def limit_nbytes(self) -> int | None:
        """The allocations a forward may reach while write-backs are in flight (None off CUDA: no waiting)."""
        if not self._limit_known:
            limit = allocator_limit_nbytes(self.device) if self._limit_arg is None else self._limit_arg
            self._limit = None if limit is None else int(limit * (1 - FRAGMENTATION_MARGIN))
            self._limit_known = True
        return self._limit

    def add(self, handle: Handle, keep: torch.Tensor | None = None) -> None:
        """A write-back just started; its device copy is freed when it lands. ``keep``: a device tensor the copy
        reads that nobody else holds (a held gradient): kept alive until the copy is seen landed, so that its
        bytes count as allocated exactly while they are in flight."""
        self.settle()  # landed ones go first: a tracker nobody waits on (no forward pacing off CUDA) stays small
        if handle.done():
            return  # landed already (every copy off CUDA): nothing to wait for, nothing to keep
        self.handles.append(handle)
        if keep is not None:
            self._kept[handle] = keep
            # Dropped by whichever thread first sees the copy complete (the engine's poll at any forward, the
            # worker waiting for it, a settle here), so it never outlives the copy by more than that.
            handle.add_done_callback(self._release_kept)

    def _release_kept(self, handle: Handle) -> None:
        self._kept.pop(handle, None)  # one dict operation: safe from any thread

    def settle(self) -> None:
        """Observe the write-backs that landed (their device copies are freed then)."""
        self.handles = [h for h in self.handles if not h.done()]

    def wait_all(self) -> None:
        """Wait for every write-back in flight (all of them, even when one failed; then its error is raised)."""
        handles, self.handles = self.handles, []
        error: BaseException | None = None
        for handle in handles:
            try:
                handle.wait()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def held_nbytes(self) -> int:
        """Device bytes still held by write-backs nobody has seen land."""
        return sum(h.nbytes for h in self.handles)

    def forward_begin(self) -> None:
        """A forward of the model starts: forget the marks of one that had no backward."""
        self._marks = []

    def before_forward(self, index: int) -> None:
        """Block index's training forward is next: note the memory in use, and wait for write-backs while the
        block's growth last time would take allocations past the limit."""
        if self.limit_nbytes is None:
            return
        self.settle()
        allocated = self._allocated()
        growth = self._growth.get((len(self._marks), index))
        self._marks.append((index, allocated - self.held_nbytes()))
        if growth is None or not self.handles or allocated + growth <= self.limit_nbytes:
            return
        t0 = time.perf_counter()
        while self.handles and self._allocated() + growth > self.limit_nbytes:
            self.handles.pop(0).wait()  # the oldest lands first (one copy stream, in order); its copy is freed
        self.waits += 1
        self.wait_s += time.perf_counter() - t0

    def forward_end(self) -> None:
        """The training forward ended (its backward begins): each block's growth is the memory allocated
        between its start and the next block's (write-backs held excluded); then every write-back still in
        flight lands first, so the backward, and the state streamed in as it frees memory, start from the
        memory the forward alone left."""
        self.settle()
        if self.limit_nbytes is None:
            self._marks = []
            return
        end = self._allocated() - self.held_nbytes()
        for position, ((index, at), (_, following)) in enumerate(zip(self._marks, self._marks[1:] + [(-1, end)], strict=False)):
            self._growth[(position, index)] = max(0, following - at)
        self._marks = []
        if self.handles:
            t0 = time.perf_counter()
            self.wait_all()
            self.waits += 1
            self.wait_s += time.perf_counter() - t0
