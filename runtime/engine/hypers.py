"""The parameter groups' AdamW values as the step reads them.

The optimizer's ``param_groups`` are read through ``source`` (``runtime.model.optimizer`` sets it): when a block's
update is queued, or, when updates wait for the commit, once at the commit (``freeze``), so that one commit reads
one set of values. A streaming step (updates start as gradients land) keeps the values its first update read and
says once when ``step()`` finds them changed. What it leaves out: the groups themselves (the optimizer's) and the
arithmetic (``runtime.update.adam``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from runtime.core.blocks import Block
from runtime.update.adam import AdamWHyper

log = logging.getLogger(__name__)


class StepHypers:
    """Each block's parameters' AdamW hyper-parameters, read from the optimizer's groups."""

    def __init__(self, default: AdamWHyper, blocks: list[Block]):
        self.source: Callable[[], list[AdamWHyper]] = lambda: [default]
        self.slot_groups: list[list[int]] = [[0] * len(block.slots) for block in blocks]  # each parameter's group
        self._frozen: list[AdamWHyper] | None = None  # the groups as a commit read them
        self._read: list[AdamWHyper] | None = None  # streaming: the groups as this step's first update read them
        self._warned = False

    def block_hypers(self, block: Block) -> list[AdamWHyper]:
        """Each of block's parameters' AdamW hyper-parameters, as its parameter group holds them now."""
        groups = self._frozen if self._frozen is not None else self.source()
        return [groups[g] for g in self.slot_groups[block.index]]

    def freeze(self) -> None:
        """A commit reads the groups once, before anything is queued: one that can't be read (a scheduler's bad
        value) fails the commit with nothing changed, not after some blocks' updates (found by a fuzz)."""
        self._frozen = self.source()

    def thaw(self) -> None:
        """The commit is over: later reads see the groups as they are then."""
        self._frozen = None

    def note_streaming_read(self) -> None:
        """A streaming update is queued: the step's updates take the groups as they are now."""
        if self._read is None:
            self._read = self.source()

    def forget_read(self) -> None:
        """A step's first backward: nothing a dropped step read is compared any more."""
        self._read = None

    def warn_if_changed_since_backward(self) -> None:
        """Streaming updates took the parameter groups' values (lr, betas, eps, weight_decay) as the backward found
        them; a change made after the backward, before ``step()``, applies from the next step, where plain
        PyTorch applies it to this one. Said once a session, not silently."""
        read, self._read = self._read, None
        if read is None or self._warned or read == self.source():
            return
        self._warned = True
        log.warning("optimizer.param_groups changed between backward() and step() (lr, betas, eps or weight_decay): "
                    "this step's updates started as its gradients landed and used the values the backward found; "
                    "the change applies from the next step. Change them before the forward (a scheduler's step() "
                    "after optimizer.step() does), or set optimizer.user_grad_clip: true so that updates wait for "
                    "optimizer.step() and read them there")
