"""What the engine's parts may read of the step in progress, and ask of the gradients summed in host memory.

The parts split out of the controller (``runtime.engine.clipping``'s ``GradClipper``, ``runtime.update.device_updates``,
``runtime.model.state_access``) are handed the collaborators they use (the store, the weights, the worker) and, for
the step itself, a ``StepView``: read-only, so none of them can move the step along or reach the rest of the
controller. The controller is the one implementation; the Protocol is what the parts are written against, and
what keeps them from importing the controller (no cycle, not even under ``TYPE_CHECKING``).

What it leaves out: how the step moves (``runtime.engine.controller``), the phase table (``runtime.engine.step_phase``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.engine.options import RuntimeOptions
from runtime.engine.step_phase import StepPhase


class StepView(Protocol):
    """Read-only: where the step in progress is, and the facts of the placement the parts act on."""

    @property
    def options(self) -> RuntimeOptions:
        """The resolved runtime options (replaced, never changed, by a placement change)."""

    @property
    def optimizer_step(self) -> int:
        """Committed optimizer steps."""

    def committed_event(self, step: int) -> torch.cuda.Event | None:
        """On a GPU with several processes: the event recorded after commit ``step``'s device work was queued."""

    @property
    def phase(self) -> StepPhase:
        """Where the step in progress is."""

    @property
    def last_micro(self) -> bool:
        """True when the backward in progress (or next) is the last before an optimizer step."""

    @property
    def step_pending(self) -> bool:
        """True from the first backward of a step until optimizer.step() commits it."""

    @property
    def deferred(self) -> bool:
        """Updates wait for the step's commit (clipping, fp16 overflow, the user's clip)."""

    @property
    def interrupted(self) -> str | None:
        """Why the blocks are at different steps, or None."""

    @property
    def gpu_updated(self) -> frozenset[int]:
        """Blocks whose master and moments live on the device and update there."""

    @property
    def gpu_streamed(self) -> frozenset[int]:
        """Blocks updated on the device over state streamed in from host memory."""

    def in_backward_use(self, index: int) -> bool:
        """True while block index's weights are held for a backward (or its recomputation), or for the next acquire."""

    def update_under_way(self, index: int) -> bool:
        """True when block index's update of the pending step started before optimizer.step() (streaming)."""

    def check_open(self) -> None:
        """Raise, saying what to do, when the session was closed."""

    def param_steps(self, block_index: int) -> list[torch.Tensor]:
        """The AdamW step counters of a block's parameters (the tensors themselves: a load fills them)."""


class HostSumAccess(Protocol):
    """Between micro-batches, the gradients summed in host memory as ``p.grad`` serves them ([Note: host gradient
    sums] in ``runtime.engine.host_sums``)."""

    def host_sum_holds(self, slot: tuple[int, int]) -> bool:
        """Parameter ``slot`` has a gradient summed in host memory this step."""

    def host_sum_of(self, slot: tuple[int, int]) -> torch.Tensor:
        """Parameter ``slot``'s host sum so far, in its shape (a view: a write changes what the step updates with)."""

    def drop_host_sum(self, slot: tuple[int, int]) -> None:
        """Drop parameter ``slot``'s host sum of the step so far, as plain PyTorch drops its accumulated ``.grad``."""
