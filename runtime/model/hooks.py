"""Every module and tensor hook the runtime uses, registered in one place and removable as a set.

- the model's forward pre-hook opens a step (``Controller.on_step_begin``);
- each hooked module's forward pre-hook acquires the blocks it needs, its forward hook releases them and,
  when gradients will flow, hooks the module's outputs so that the module's backward acquires them again;
- each parameter's post-accumulate-grad hook counts the block's finished gradients; the first one of a
  backward queues an end-of-backward callback on the autograd engine.

A backward is a micro-batch of the optimizer step only when it accumulates into an offloaded parameter's ``.grad``.
One that does not (``torch.autograd.grad`` of an input's or a parameter's gradient: a saliency map, gradients the
user assigns to ``.grad`` themselves; ``backward(inputs=[x])``) still needs each block's weights for its arithmetic:
its modules' hooks acquire them through ``Controller.on_grad_only_backward`` and release them at its end, and the
step is left as it was. A backward that builds a graph of itself (``create_graph=True``: double backward, a
gradient penalty) is refused: the graph it builds reads each block's weights again, in an order no module hook
sees, after the block was released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from runtime.core.blocks import Block
from runtime.core.signals import defers_interrupts
from runtime.engine.controller import Controller
from runtime.engine.torch_calls import GRAD_SET

log = logging.getLogger(__name__)


def in_backward() -> bool:
    """True inside the autograd engine (e.g. the recomputation of activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


def refuse_create_graph() -> None:
    """Raise when the running backward builds a graph of itself: the engine runs a backward in grad mode exactly when
    it was called with ``create_graph=True``."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "a backward with create_graph=True (torch.autograd.grad(..., create_graph=True) for a gradient penalty, "
            "double backward) reached an offloaded block: the graph it builds reads the block's weights again in a "
            "later backward, after tierstore released them, in an order no hook of tierstore's sees: higher-order "
            "gradients are not supported. Nothing of the step changed. Compute the penalty without create_graph (a "
            "finite-difference estimate of the gradient's norm, say), or train this model without offload")


def _will_accumulate(param: torch.Tensor) -> bool:
    """Whether the running backward will add into ``param.grad``: the engine executes its gradient accumulator. A
    parameter ``torch.autograd.grad`` returns has its accumulator captured, not run (the engine refuses the question
    with a RuntimeError then)."""
    with torch._C.DisableTorchFunctionSubclass():  # metadata and a view only: not through the parameter guard
        if not param.requires_grad:
            return False
        with torch.enable_grad():
            accumulator = cast(Any, param.view_as(param).grad_fn).next_functions[0][0]  # the live one, the graph's
    try:
        return torch._C._will_engine_execute_node(accumulator)
    except RuntimeError:  # "a leaf node was passed ... while running autograd.grad()": captured
        return False


def _inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a pickled or copied model holds in place of a session's hook: the copy is no offloaded model."""
    return None


def _inert() -> Callable[..., None]:
    return _inert_hook


class SessionHook:
    """A module hook of one session: called as the function it wraps. A pickle of the model (``torch.save(model)``)
    or a ``copy.deepcopy`` gets ``_inert_hook`` in its place: the function itself is a closure, which pickle refuses
    (the whole save failed), and a copy must not drive this session. Every hook runs with Ctrl-C and SIGTERM held
    back until it returns ([Note: deferred interrupts]). No ``__slots__``: torch marks some hooks with an attribute."""

    def __init__(self, fn: Callable[..., Any]):
        self._fn = defers_interrupts(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _inert, ()


class HookSet:
    """Registers the runtime's hooks on a model; ``remove()`` takes them all off."""

    def __init__(self, model: nn.Module, blocks: list[Block], controller: Controller):
        self.controller = controller
        self._handles: list[Any] = []
        self._ends_queued: set[Callable[[], None]] = set()  # end-of-backward calls queued on the autograd engine
        # The offloaded parameters, and whether the graph task seen last (its id) accumulates into any of them.
        self._params = [slot.param for block in blocks for slot in block.slots]
        self._task: tuple[int, bool] = (-1, False)
        self._module_blocks = self._needed_blocks(model, blocks)
        # Module hooks are closures that act only for the module they were registered on, held in a SessionHook: a
        # copy.deepcopy or a pickle of the model gets an inert hook instead, and must not drive this session anyway.
        self._handles.append(model.register_forward_pre_hook(SessionHook(self._make_root_pre_forward(model))))
        # always_call: it runs when the forward raises too, so the controller knows no forward is running then.
        self._handles.append(model.register_forward_hook(SessionHook(self._make_root_post_forward(model)), always_call=True))
        for module, indices in self._module_blocks.items():
            self._handles.append(module.register_forward_pre_hook(SessionHook(self._make_pre_forward(indices, module))))
            self._handles.append(module.register_forward_hook(SessionHook(self._make_post_forward(indices, module))))
        param_grad = defers_interrupts(self._param_grad)
        for block in blocks:
            for slot in block.slots:
                self._handles.append(slot.param.register_post_accumulate_grad_hook(param_grad))

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

    def _make_root_pre_forward(self, root: nn.Module):
        def root_pre_forward(module: nn.Module, args: Any) -> None:
            if module is root and not in_backward():
                # No backward runs now: an end-of-backward callback still marked queued belonged to a backward
                # that raised (the engine drops its callbacks then).
                self._ends_queued.clear()
                self.controller.on_step_begin()

        return root_pre_forward

    def _make_root_post_forward(self, root: nn.Module):
        def root_post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if module is root and not in_backward():
                self.controller.on_forward_end()

        return root_post_forward

    def _make_pre_forward(self, indices: list[int], hooked: nn.Module):
        def pre_forward(module: nn.Module, args: Any) -> None:
            if module is not hooked:
                return
            if in_backward() and not self._accumulates():
                # A recomputation (activation checkpointing) inside a backward that is no micro-batch: its blocks
                # are held like that backward's, until it ends, not as a training backward's would be.
                self._queue_end_of_grad_only_backward()
                self.controller.on_grad_only_backward(indices)
                return
            self.controller.acquire(indices, "recompute" if in_backward() else "fwd")

        return pre_forward

    def _make_post_forward(self, indices: list[int], hooked: nn.Module):
        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if module is not hooked:
                return
            recompute = in_backward()
            self.controller.release_after_forward(indices, "recompute" if recompute else "fwd")
            if torch.is_grad_enabled() and not recompute:
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, defers_interrupts(lambda grads: self._pre_backward(indices)), mode="any")

        return post_forward

    def _pre_backward(self, indices: list[int]) -> None:
        refuse_create_graph()
        if self._accumulates():
            self._queue_end_of_backward()
            self.controller.on_backward_begin(indices)
        else:
            self._queue_end_of_grad_only_backward()
            self.controller.on_grad_only_backward(indices)

    def _param_grad(self, param: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # backward(create_graph=True): .grad holds a graph that reads the weights
            with torch._C.DisableTorchFunctionSubclass():  # not through the parameter guard: nothing to drop there
                GRAD_SET(param, None)
            refuse_create_graph()
        self._queue_end_of_backward()
        self.controller.on_param_grad(param)  # type: ignore[arg-type]

    def _accumulates(self) -> bool:
        """Whether the running backward accumulates into some offloaded parameter's ``.grad`` (asked once per graph
        task: its modules' hooks all get the same answer)."""
        task = torch._C._current_graph_task_id()
        if self._task[0] != task:
            self._task = (task, any(_will_accumulate(p) for p in self._params))
        return self._task[1]

    def _queue_end_of_backward(self) -> None:
        self._queue_end(self.controller.on_backward_end)

    def _queue_end_of_grad_only_backward(self) -> None:
        self._queue_end(self.controller.on_grad_only_backward_end)

    def _queue_end(self, on_end: Callable[[], None]) -> None:
        """Have the autograd engine call ``on_end`` when the running backward ends, once per backward."""
        if on_end in self._ends_queued:
            return
        self._ends_queued.add(on_end)

        @defers_interrupts
        def end() -> None:
            self._ends_queued.discard(on_end)
            on_end()

        torch.autograd.Variable._execution_engine.queue_callback(end)

    def remove(self) -> None:
        """Take every hook off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []



class StateDictHooks:
    """``state_dict()`` of an offloaded model holds the current weights; ``load_state_dict`` writes into the tiers.

    The entries of offloaded parameters are CPU tensors in the parameter's dtype (the compute dtype), read
    from the fp32 master: equal to the weights the next forward computes with. A block is read once per
    ``state_dict()`` call (tied parameters give the same tensor). With ``keep_vars=True`` the entries are
    the parameters themselves, as in torch. Loading goes through each parameter's ``copy_``, which the
    parameter guard applies to the fp32 master (``runtime.model.param_guard``).
    """

    def __init__(self, model: nn.Module, blocks: list[Block], read_block: Any, begin_load: Any, end_load: Any):
        self._read_block = read_block  # read_block(block) -> {name: tensor}
        # A load_state_dict() call gathers its writes and finishes them once at its end (or at the next forward,
        # when the load raised half-way).
        self._begin_load, self._end_load = begin_load, end_load
        self._loading: bool | None = None  # a load_state_dict() call is gathering writes
        self._load_opener: nn.Module | None = None
        self._slots = {id(slot.param): (block, slot) for block in blocks for slot in block.slots}
        self._modules = {id(module) for module in model.modules()}  # a deepcopy's modules are not ours
        self._cache: dict[int, dict[str, torch.Tensor]] = {}  # block index -> values, during one call
        self._destination: Any = None  # the dict the cached call fills (a call that raised never cleared it)
        self._keep_vars = False
        self._handles: list[Any] = []
        # Not bound methods: torch marks the post-hook with an attribute (SessionHook takes one).
        def pre(module: nn.Module, *args: Any) -> None:
            if id(module) in self._modules:
                self._pre(module, *args)

        def post(module: nn.Module, *args: Any) -> None:
            if id(module) in self._modules:
                self._post(module, *args)

        def pre_load(module: nn.Module, *args: Any) -> None:
            if id(module) in self._modules:
                self._pre_load(module, *args)

        def post_load(module: nn.Module, incompatible: Any) -> None:
            if module is self._load_opener:
                self._finish_load()

        def before_forward(module: nn.Module, args: Any) -> None:
            if id(module) in self._modules:
                self._finish_load()

        self._handles.append(model.register_forward_pre_hook(SessionHook(before_forward)))
        pre, post, pre_load, post_load = map(SessionHook, (pre, post, pre_load, post_load))
        for module in model.modules():  # every module: the outermost state_dict() call opens the cache
            self._handles.append(module.register_state_dict_pre_hook(pre))
            self._handles.append(module.register_state_dict_post_hook(post))
            self._handles.append(module.register_load_state_dict_pre_hook(pre_load))
            self._handles.append(module.register_load_state_dict_post_hook(post_load))

    def _pre(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self._keep_vars = keep_vars  # the same for every module of one call

    def _post(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if state_dict is not self._destination:  # a new state_dict() call: nothing cached belongs to it
            self._destination, self._cache = state_dict, {}
        if not self._keep_vars:
            for name, param in module._parameters.items():
                found = self._slots.get(id(param)) if param is not None else None
                key = prefix + name
                if found is None or key not in state_dict:
                    continue
                block, slot = found
                if block.index not in self._cache:
                    self._cache[block.index] = self._read_block(block)
                state_dict[key] = self._cache[block.index][slot.name]
        if not prefix:  # the outermost module of this call is done: let the copies go with the caller's dict
            self._destination, self._cache = None, {}

    def _finish_load(self) -> None:
        if self._loading is not None:
            self._loading, self._load_opener = None, None
            self._end_load()

    def _pre_load(self, module: nn.Module, state_dict: Any, prefix: str, local_metadata: Any, *args: Any) -> None:
        if self._loading is None:  # the outermost module of this load_state_dict() call (its pre-hook runs first)
            self._loading, self._load_opener = True, module
            self._begin_load()
        if local_metadata.get("assign_to_params_buffers") and any(id(p) in self._slots for p in module._parameters.values()):
            raise RuntimeError("load_state_dict(assign=True) would replace the offloaded parameters; call it without "
                               "assign: the values are written into the tiers")

    def remove(self) -> None:
        """Take the hooks off."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
