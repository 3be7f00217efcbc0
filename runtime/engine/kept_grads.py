"""Which offloaded parameters plain PyTorch would hold a ``.grad`` tensor for, so that ``zero_grad(set_to_none=False)``
updates as it does there.

In plain PyTorch a parameter keeps its ``.grad`` tensor after ``optimizer.step()``; ``zero_grad(set_to_none=False)``
fills it with zeros, and the next ``step()`` updates every parameter whose ``.grad`` is a tensor: one the step's
backwards did not reach is updated with a zero gradient (its momentum decays, weight decay acts, its step count
moves), and a ``step()`` with no backward at all updates each of them so. tierstore takes a block's gradient off the
parameters for its update, so it keeps, per block and parameter, whether plain PyTorch would hold a tensor there
(one gradient in any step since the last ``zero_grad(set_to_none=True)``), and while the last ``zero_grad`` kept
zeros, a step counts those parameters as having a zero gradient (``Gradients.offload`` in ``runtime.engine.gradients``).

``p.grad = None`` drops the parameter's tensor (``GradClipper.on_grad_set`` says so), as in plain PyTorch.

Between steps a parameter held here reads, as ``p.grad``, a stand-in of that gradient (``runtime.engine.clipping``: its data
went to the step's update): so the module's ``model.zero_grad()`` finds it and clears it (``p.grad = None`` drops it
here) or zeroes it (zeros kept), as it does plain PyTorch's. Zeros are kept only until a step with a backward
commits: plain PyTorch's ``.grad`` tensors then hold that step's gradients, not zeros. A later step with no
``zero_grad`` at all adds to them, or applies them again: not emulated, said once (``Controller``). Pure
bookkeeping: no tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class KeptGrads:
    """Per block, per parameter: whether plain PyTorch would hold a ``.grad`` tensor now; and whether the last
    ``optimizer.zero_grad`` kept those tensors as zeros."""

    def __init__(self, slots_per_block: Sequence[int]):
        self._held = [[False] * count for count in slots_per_block]
        self._zeroed = [[False] * count for count in slots_per_block]  # zeroed one by one (p.grad.zero_())
        self.zeros_kept = False

    def merge(self, index: int, has_grad: list[bool]) -> list[bool]:
        """Block ``index``'s step takes gradients for the parameters ``has_grad`` marks: returns the parameters it
        updates (those, and while zeros are kept, every one plain PyTorch holds a zeroed ``.grad`` for), and records
        them as holding a ``.grad`` from now on."""
        held, zeroed = self._held[index], self._zeroed[index]
        has_grad = [a or (b and (self.zeros_kept or z)) for a, b, z in zip(has_grad, held, zeroed, strict=False)]
        self._held[index] = [a or b for a, b in zip(has_grad, held, strict=False)]
        return has_grad

    def zero_grad(self, set_to_none: bool, present: Iterable[tuple[int, int]] = ()) -> None:
        """``optimizer.zero_grad(set_to_none)``: None drops every held ``.grad``; zeros keep them, with the
        parameters ``present`` lists ((block, position): gradients of a step in progress) held too."""
        self.zeros_kept = not set_to_none
        self._zeroed = [[False] * len(held) for held in self._held]
        if set_to_none:
            self._held = [[False] * len(held) for held in self._held]
            return
        for index, position in present:
            self._held[index][position] = True

    def zero_slot(self, index: int, position: int) -> None:
        """``p.grad.zero_()`` between steps (``model.zero_grad(set_to_none=False)``, one parameter at a time): that
        one holds zeros, the others what they held."""
        if self._held[index][position]:
            self._zeroed[index][position] = True

    def _zero(self, index: int, position: int) -> bool:
        return self._held[index][position] and (self.zeros_kept or self._zeroed[index][position])

    @property
    def zero_step_pending(self) -> bool:
        """A ``step()`` with no backward would update some parameter with a zero gradient (zeros kept)."""
        return any(self._zero(i, p) for i, held in enumerate(self._held) for p in range(len(held)))

    @property
    def last_gradients_held(self) -> bool:
        """Plain PyTorch would still hold the last step's gradients (no ``zero_grad`` since a step with a backward):
        a ``step()`` with no backward would apply them again there, and a backward would add to them."""
        return any(h and not self._zero(i, p) for i, held in enumerate(self._held) for p, h in enumerate(held))

    def holds(self, index: int, position: int) -> bool:
        """Plain PyTorch would hold a ``.grad`` tensor for parameter ``position`` of block ``index`` now."""
        return self._held[index][position]

    def drop(self, index: int, position: int) -> None:
        """``p.grad = None`` for parameter ``position`` of block ``index``: plain PyTorch holds no tensor for it."""
        self._held[index][position] = self._zeroed[index][position] = False

    def step_committed(self, had_backward: bool) -> None:
        """``optimizer.step()`` committed a step. One with a backward leaves plain PyTorch's ``.grad`` tensors
        holding its gradients, not zeros: zeros are no longer kept. One without (assigned gradients, kept zeros)
        leaves them as they were."""
        if had_backward:
            self.zeros_kept = False
            self._zeroed = [[False] * len(held) for held in self._held]
