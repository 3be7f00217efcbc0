"""What the update path uses of the engine above it, declared here as Protocols so that ``update/`` never imports
``engine/``: the blocks' compute weights (``runtime.engine.weights.WeightManager`` is the one implementation),
the device's write-backs (``runtime.engine.writeback.DeviceWritebacks``) and the user's clip factors
(``runtime.engine.clipping.GradClipper``).

What it leaves out: any behaviour; these are the narrow surfaces the worker and the device updates are written
against (the engine hands its objects in, and mypy checks that they fit).
"""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.core.blocks import Block
from runtime.planning.memory_plan import WeightSource
from tierstore import Handle


class ComputeWeights(Protocol):
    """The blocks' compute-dtype weights on the device, as an update refreshes them from a new master."""

    @property
    def source(self) -> WeightSource:
        """Where a block's compute weights are fetched (or recast) from."""

    def nbytes(self, index: int) -> int:
        """Device bytes of block index's compute weights."""

    def load_resident(self, index: int, master: torch.Tensor | None = None) -> None:
        """Make block index's weights resident, cast from ``master`` (default: its host master)."""

    def refresh_resident(self, index: int, staging: torch.Tensor, may_hold: bool = True) -> Handle | None:
        """Recast resident weights from the host master through ``staging``; returns a copy still reading it."""

    def fill_from_device(self, index: int, master: torch.Tensor) -> bool:
        """Cast fetched weights from a device master; True when they are now current."""

    def hold_refreshes(self) -> None:
        """Queue resident-weight refreshes until ``release_refreshes``."""

    def release_refreshes(self) -> None:
        """Issue the queued refreshes."""


class WritebackQueue(Protocol):
    """Copies off the device whose landing the next forward paces itself by ([Note: paced write-back])."""

    def add(self, handle: Handle, keep: torch.Tensor | None = None) -> None:
        """Track one copy in flight (``keep``: a tensor to hold until it lands)."""

    def settle(self) -> None:
        """Forget the copies that have landed."""


class ClipFactors(Protocol):
    """The user's side of the pending step's clip: factors and dropped gradients, applied at the commit."""

    def kept(self, block: Block, has_grad: list[bool]) -> list[bool]:
        """has_grad without the parameters whose gradient the user dropped after backward."""

    def user_scales(self, block: Block) -> list[torch.Tensor | None] | None:
        """The user's scale factor of each of block's parameters (None: none scaled)."""
