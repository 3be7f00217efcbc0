"""Gradients of host-updated blocks held on the device until the step commits.

[Note: held gradients] When updates wait for the commit (clipping, fp16 loss scaling, the user's own
clipping), a host-updated block's gradient used to leave the device as soon as its backward finished, and at
the commit the CPU multiplied it by the clip coefficient: one more pass over host memory per parameter, on the
critical path (the CPU's AdamW is memory-bound, and the pass cost about a third of the kernel's time). Held
here instead, the gradient is scaled on the device at the commit (the same fp32 multiply, so the same bits)
and only then copied to host, in forward order and ahead of the streamed state's write-backs, so the CPU
starts the first block's update a few milliseconds after the commit and skips the pass.

Holding must not raise the step's peak, nor take the room streamed blocks' state needs: a gradient is held only
while the memory allocated on the device stays within what was allocated when the backward began (the
backward frees activations as it goes), and while everything held plus all the streamed blocks' state fits in
what the step's activations took (allocated when the backward began less allocated when the forward began,
not counting copies to host still in flight then): by the commit the backward has freed all of it, so the
streamed state still finds its room then, however early the holds took it. Otherwise the gradient leaves at
once, as before, and the worker scales it. (A first rule that kept the streamed state's room free *during* the
backward held 6 of 14 host blocks' gradients on the benchmark model under DeepSpeed ZeRO-2's memory, H100,
2026-11-27.) A host update that runs before the commit (``runtime.update.speculation``) holds nothing: it needs the
gradient on host during the backward. Without CUDA (the CPU tests) the room is not limited.

Bytes allocated are not all the caching allocator needs: held gradients pin blocks of its cache that the
backward's transient tensors and the next forward's activations would have reused, and under a capped GPU a
request it cannot place makes it give its whole cache back and synchronize the device (an allocation retry).
Their copies to host are tracked with the streamed write-backs (``runtime.engine.writeback``; each held tensor is kept
alive until its copy completes, so its bytes count as allocated exactly while they are in flight), so the next
forward waits for them where a block would not fit, and a step whose window (from one backward's start to the
next) saw a retry halves the bytes later steps may hold (but for a first window with a single retry). On the benchmark model
under DeepSpeed ZeRO-2's memory (H100, 2026-11-27) holding every host block's gradient without these two took a
run's retries from 0-4 to 2-9; with them, three of four 6-step runs under ZeRO-2's cap saw one retry (in step 3
or 4) and none after it, and halving at that first one cost each 30-37 ms a step of host multiply for the rest
of the run: one retry is one device synchronization, so a first window with a single retry is let pass. The
retry count is the process's: a retry of another model's run counts too, and the limit never grows back within a
session. Holding keeps memory in use within what the backward began with at each hold, not at every moment after
it: a later block's transient tensors come on top of what is held, which is what a retry, if it comes, corrects.

A step holds only where the host would otherwise multiply: the clip (ours, or the user's through
``clip_grad_norm_``) scaled the last committed step's gradients by a factor other than 1, the best guess for
this one (the first step, with a clip configured, guesses that it will). Without a factor to apply (fp16 loss
scaling alone, a clip that does not bind) the gradients leave during the backward, where their copy overlaps
it.

What it leaves out: when the commit happens and what runs after it (``runtime.engine.controller``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class HeldGrads:
    """Device gradients (fp32, flat, one per block) of the pending step, by block index."""

    def __init__(self, device: torch.device):
        self.device = device
        self._held: dict[int, torch.Tensor] = {}
        self._base: int | None = None  # device bytes allocated when the last training forward began
        self._ceiling: int | None = None  # device bytes allocated when the step's last backward began
        self._streamed_state_nbytes = 0  # every streamed block's state, which comes into the same room by the commit
        self.limit_nbytes: int | None = None  # most bytes a step may hold (None: the room decides alone)
        self._retries: int | None = None  # the allocator's retries when the last step's backward began
        self._held_last = 0  # bytes the last step held
        self._retry_tolerated = False  # a window with a retry was seen and let pass (the next one halves)

    def forward_begin(self, in_flight: Callable[[], int] = lambda: 0) -> None:
        """A training forward starts: what is allocated now, less ``in_flight()`` (device bytes of copies to
        host still under way, which land during the forward: the last step's write-backs and held gradients),
        is what its activations come on top of. ``in_flight`` is read after the allocation, so a copy landing
        in between is counted as still allocated (the room comes out smaller, never larger)."""
        if self.device.type != "cuda":
            self._base = None
            return
        allocated = torch.cuda.memory_allocated(self.device)
        self._base = allocated - in_flight()

    def begin(self, streamed_state_nbytes: int = 0) -> None:
        """The backward that ends the step starts: its memory in use now bounds what may be held, less
        ``streamed_state_nbytes`` (device bytes of every streamed block's state, which comes into the same room
        by the commit); a retry of the allocator since the last step's began halves what may be held from now on,
        except the session's first window with a single retry (see the note)."""
        if self.device.type != "cuda":
            return
        self._streamed_state_nbytes = streamed_state_nbytes
        self._ceiling = torch.cuda.memory_allocated(self.device)
        retries = int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))
        if self._retries is not None and retries > self._retries and self._held_last > 0:
            if self._retry_tolerated or retries - self._retries > 1:
                self.limit_nbytes = self._held_last // 2
            self._retry_tolerated = True
        self._retries = retries
        self._held_last = 0

    def try_hold(self, index: int, flat: torch.Tensor) -> bool:
        """Keep block index's gradient ``flat`` (already allocated) on the device if the room allows it (see
        the note)."""
        if self.device.type == "cuda":
            if self._ceiling is None or self._base is None:
                return False
            room = self._ceiling - self._base
            held = self.nbytes + flat.numel() * flat.element_size()
            if torch.cuda.memory_allocated(self.device) > self._ceiling or held + self._streamed_state_nbytes > room:
                return False
            if self.limit_nbytes is not None and held > self.limit_nbytes:
                return False
        self._held[index] = flat
        return True

    def take(self) -> dict[int, torch.Tensor]:
        """Every held gradient in forward order; none are held afterwards."""
        self._held_last = self.nbytes
        held, self._held = self._held, {}
        return dict(sorted(held.items()))

    def drop(self) -> None:
        """A dropped step: its held gradients go (what it held still counts, as at a commit, should the allocator
        have retried in its window)."""
        self._held_last = self.nbytes
        self._held = {}
        self._ceiling = None

    @property
    def nbytes(self) -> int:
        """Device bytes held now."""
        return sum(flat.numel() * flat.element_size() for flat in self._held.values())
