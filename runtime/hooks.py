"""Every module and tensor hook the runtime uses, registered in one place and removable as a set.

- the model's forward pre-hook opens a step (``Controller.on_step_begin``);
- each hooked module's forward pre-hook acquires the blocks it needs, its forward hook releases them and,
  when gradients will flow, hooks the module's outputs so that the module's backward acquires them again;
- each parameter's post-accumulate-grad hook counts the block's finished gradients; the first one of a
  backward queues an end-of-backward callback on the autograd engine.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from runtime.blocks import Block
from runtime.controller import Controller

log = logging.getLogger(__name__)


def _in_backward() -> bool:
    """True inside the autograd engine (e.g. the recomputation of activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


class HookSet:
    """Registers the runtime's hooks on a model; ``remove()`` takes them all off."""

    def __init__(self, model: nn.Module, blocks: list[Block], controller: Controller):
        self.controller = controller
        self._handles: list[Any] = []
        self._end_queued = False
        self._module_blocks = self._needed_blocks(model, blocks)
        self._handles.append(model.register_forward_pre_hook(self._root_pre_forward))
        for module, indices in self._module_blocks.items():
            self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(indices)))
            self._handles.append(module.register_forward_hook(self._make_post_forward(indices)))
        for block in blocks:
            for slot in block.slots:
                self._handles.append(slot.param.register_post_accumulate_grad_hook(self._param_grad))

    @staticmethod
    def _needed_blocks(model: nn.Module, blocks: list[Block]) -> dict[nn.Module, list[int]]:
        """For each hooked module, the blocks whose parameters its forward uses."""
        owner = {id(slot.param): block.index for block in blocks for slot in block.slots}
        needed: dict[nn.Module, list[int]] = {}
        for block in blocks:
            for module in block.modules:
                params = module.parameters(recurse=block.is_layer and module is block.modules[0])
                indices = sorted({owner[id(p)] for p in params if id(p) in owner})
                if indices:
                    needed[module] = indices
        return needed

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if not _in_backward():
            self.controller.on_step_begin()

    def _make_pre_forward(self, indices: list[int]):  # type: ignore[no-untyped-def]
        def pre_forward(module: nn.Module, args: Any) -> None:
            self.controller.acquire(indices, "recompute" if _in_backward() else "fwd")

        return pre_forward

    def _make_post_forward(self, indices: list[int]):  # type: ignore[no-untyped-def]
        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            recompute = _in_backward()
            self.controller.release_after_forward(indices, "recompute" if recompute else "fwd")
            if torch.is_grad_enabled() and not recompute:
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._pre_backward(indices), mode="any")

        return post_forward

    def _pre_backward(self, indices: list[int]) -> None:
        self._queue_end_of_backward()
        self.controller.on_backward_begin(indices)

    def _param_grad(self, param: torch.Tensor) -> None:
        self._queue_end_of_backward()
        self.controller.on_param_grad(param)  # type: ignore[arg-type]

    def _queue_end_of_backward(self) -> None:
        if self._end_queued:
            return
        self._end_queued = True

        def end() -> None:
            self._end_queued = False
            self.controller.on_backward_end()

        torch.autograd.Variable._execution_engine.queue_callback(end)

    def remove(self) -> None:
        """Take every hook off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

