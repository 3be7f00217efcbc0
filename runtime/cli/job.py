"""What one ``tierstore train`` run trains: the model, its batches and its loss (``TrainJob``).

Owns: the shape every model source gives the training loop (the bundled example in ``runtime.cli.train``, a local
HF model directory in ``runtime.cli.train_hf``). Leaves out: the loop itself, checkpoints and output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from runtime.model.materialize import ParamInit

if TYPE_CHECKING:
    from runtime.session import OffloadSession


class Batches(Protocol):
    """A resumable stream of micro-batches (``runtime.checkpoint.state.ResumableData`` with ``next()``)."""

    position: int
    generator: torch.Generator
    batch_size: int
    seq_len: int

    def next(self) -> Any:
        """The next micro-batch, on the CPU."""


@dataclass
class TrainJob:
    """A model to offload and train, its batches and how a micro-batch becomes a loss.

    ``init``: fills the model's parameters block by block when it was built on the meta device (``offload``'s
    ``init``). ``after_offload``: runs once every block is filled (e.g. closes the weight files ``init`` read).
    ``finish``: runs after the last step, before the session closes (e.g. writes ``--output``)."""

    model: nn.Module
    data: Batches
    loss: Callable[[nn.Module, Any, torch.device], torch.Tensor]
    init: ParamInit | None = None
    after_offload: Callable[[], None] | None = None
    finish: Callable[[OffloadSession], None] | None = None
