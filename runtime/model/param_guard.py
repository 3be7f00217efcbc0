"""Parameters of an offloaded model stay safe to read and write outside forward and backward.

Between uses a block's compute weights occupy no device memory: its parameters are views of a zero-byte
storage (autograd's saved tensors see the bytes fetched again for backward). Touching such a view directly
would read freed memory -- a segfault on the CPU, an illegal memory access that kills the CUDA context.

So each offloaded parameter's class becomes a subclass of its own class (still an ``nn.Parameter``) whose
``__torch_function__`` routes every torch call on it:

- inside the block's own forward or backward (the hooks acquired it): the call runs as is, but for a write
  into the parameter (a hook registered after ``offload()``, ``nn.Embedding(max_norm=...)``), which is refused: it
  would change only the compute copy fetched for the pass, not the fp32 master;
- metadata (shape, dtype, device, ``.grad``, hooks, ``requires_grad``): as is, nothing fetched;
- views: returned *guarded* as well, so a view taken now reads correctly later (it fetches the block again
  if it was released meanwhile); ``detach()`` and ``.data`` fetch nothing;
- in-place writes (``copy_``, ``fill_``, ``mul_``, ... -- what ``load_state_dict`` does; an ATen overload such as
  ``torch.ops.aten.mul_.Tensor``; a functional call with ``inplace=True``; ``torch._foreach_*_`` over a list, done one
  parameter at a time): applied to the fp32 master in the same place, then the compute copies are refreshed; Adam's
  moments are untouched;
- any other read (``norm``, ``clone``, ``repr``, ``.cpu()``): the block's current weights are fetched to
  the device first and stay until the next forward.

``p.grad`` of a parameter whose gradient has already left the device for the pending step returns an
``OffloadedGrad``: a tensor with the gradient's metadata and no storage, on which the norm and scaling
calls of ``torch.nn.utils.clip_grad_norm_`` act on the offloaded gradient exactly (see ``runtime.engine.clipping``);
any other use raises an error that says what to call instead.

No attribute is added to a parameter: the guard finds a tensor's block by its storage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast

import torch

from runtime.core.blocks import Block
from runtime.core.signals import defers_interrupts
from runtime.engine.clipping import GradClipper
from runtime.engine.torch_calls import CUDA, DATA_SET, GRAD_GET, GRAD_SET, TO, no_op_cuda, no_op_to
from runtime.model.state_access import StateAccess

log = logging.getLogger(__name__)


def _getters(*names: str) -> set[Any]:
    return {getattr(torch.Tensor, name).__get__ for name in names if hasattr(torch.Tensor, name)}


def _setters(*names: str) -> set[Any]:
    return {getattr(torch.Tensor, name).__set__ for name in names if hasattr(torch.Tensor, name)}


def _methods(*names: str) -> set[Any]:
    found = set()
    for name in names:
        for owner in (torch.Tensor, torch):
            fn = getattr(owner, name, None)
            if fn is not None:
                found.add(fn)
    return found


# Calls that read or set metadata only: they never touch the bytes.
METADATA_CALLS = frozenset(
    _getters("shape", "dtype", "device", "is_cuda", "is_cpu", "is_meta", "requires_grad", "is_leaf", "grad_fn",
             "ndim", "layout", "names", "is_sparse", "is_quantized", "itemsize", "nbytes", "_base", "_version",
             "output_nr", "name", "is_nested", "is_mkldnn", "is_xpu", "is_mps")
    | _setters("requires_grad", "name")
    | _methods("size", "dim", "numel", "element_size", "stride", "storage_offset", "is_contiguous", "register_hook",
               "register_post_accumulate_grad_hook", "retain_grad", "requires_grad_", "untyped_storage", "get_device",
               "is_floating_point", "is_complex", "__len__", "nelement", "ndimension", "is_shared", "is_pinned",
               "type", "is_signed", "__setstate__")
)
# Calls whose result aliases the whole parameter: made from metadata alone, so nothing is fetched (other
# views check their bounds against the storage and are made after a fetch, like any read).
ALIAS_CALLS = frozenset(_getters("data") | _methods("detach"))
IN_PLACE_DUNDERS = frozenset(_methods("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                                      "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                                      "__irshift__"))
# Calls that hand the bytes to something torch does not track (numpy, DLPack, pickling): given a copy, so nothing
# outside can hold the block's memory when it is released.
COPY_CALLS = frozenset(_methods("numpy", "__array__", "__dlpack__", "__reduce_ex__"))
DEEPCOPY = torch.Tensor.__deepcopy__


def _tensors_in(args: Iterable[Any]) -> Iterable[torch.Tensor]:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, (list, tuple)):
            yield from (a for a in arg if isinstance(a, torch.Tensor))


def _is_in_place(func: Callable[..., Any], kwargs: dict[str, Any] | None = None) -> bool:
    """The call writes into its first argument: a method or function named with a trailing underscore, an
    in-place operator, an ATen overload whose schema marks its first argument written (``torch.ops.aten.mul_.Tensor``,
    named ``mul_.Tensor``), or a functional call with ``inplace=True`` (``F.dropout``, ``F.relu``)."""
    name = getattr(func, "__name__", "")
    if (name.endswith("_") and not name.endswith("__")) or func in IN_PLACE_DUNDERS:
        return True
    if isinstance(func, torch._ops.OpOverload):
        arguments = func._schema.arguments
        return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
    return kwargs is not None and kwargs.get("inplace") is True


def _op_name(func: Callable[..., Any]) -> str:
    """A call's name without an ATen overload's suffix (``torch.ops.aten._foreach_mul_.Scalar``: ``_foreach_mul_``)."""
    if isinstance(func, torch._ops.OpOverload):
        return func.overloadpacket.__name__
    return getattr(func, "__name__", "")


def _is_foreach_in_place(func: Callable[..., Any], args: tuple[Any, ...]) -> bool:
    """``torch._foreach_<op>_(tensors, ...)`` (or its ATen overload): in place on every tensor of its first argument,
    a list."""
    name = _op_name(func)
    return name.startswith("_foreach_") and name.endswith("_") and bool(args) and isinstance(args[0], (list, tuple))


# Foreach ops whose tensor method takes the per-tensor scalar as a keyword, not positionally.
_VALUE_KEYWORD = frozenset({"addcmul_", "addcdiv_"})


def is_offloaded(param: torch.Tensor) -> bool:
    """True for a parameter an open offload session routes (its class is one of a ``ParamGuard``'s)."""
    return type(param).__module__ == __name__ and type(param).__name__.startswith("Offloaded")


def _target_positional(func: Callable[..., Any], args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """An in-place call whose target came as a keyword, as ``torch.nn.init``'s functions pass it here
    (``nn.init.normal_(w)`` reaches ``__torch_function__`` with ``args=()`` and ``tensor=w``; ``reset_parameters()``
    calls them): the target moved first, where the write path looks for it. Without this such a call read as a
    read and changed only the fetched compute copy, never the master."""
    if args or not _is_in_place(func) or not isinstance(kwargs.get("tensor"), torch.Tensor):
        return args, kwargs
    rest = dict(kwargs)
    return (rest.pop("tensor"),), rest


class PassState(Protocol):
    """Whether a forward or backward of the model runs now, and the blocks a pass that raised left held."""

    @property
    def pass_running(self) -> bool:
        """A forward or a backward of the model is under way now."""

    def drop_raised_forward_holds(self) -> bool:
        """Release the blocks a forward that raised left held; returns whether there were any."""


class ParamGuard:
    """Routes torch calls on one session's offloaded parameters, their views and their offloaded gradients."""

    def __init__(self, blocks: list[Block], access: StateAccess, clipper: GradClipper, passes: PassState,
                 param_block: dict[int, int]):
        self.blocks = blocks
        self.access = access
        self.clipper = clipper
        self.passes = passes  # the engine's forward / backward in progress
        self.param_block = param_block  # id(parameter) -> block index
        self._storage_block: dict[int, int] = {}
        self._original_classes: dict[int, type] = {}
        guard = self

        # One subclass per session and per parameter class, so the routing reaches this session's state
        # without a global registry.
        dispatch = defers_interrupts(guard.dispatch)  # [Note: deferred interrupts]
        self._routed = classmethod(lambda cls, func, types, args=(), kwargs=None: dispatch(func, args, kwargs or {}))
        self.view_class: type = type("OffloadedView", (torch.Tensor,), {"__torch_function__": self._routed,
                                                                        "__module__": __name__})
        self._param_classes: dict[type, type] = {}
        self._deepcopy = lambda param, memo: dispatch(DEEPCOPY, (param, memo), {})
        self._closed = False  # the session closed: views still held refer to freed blocks

    # ---- install / remove ------------------------------------------------------------------------------
    def install(self) -> None:
        """Route the calls of every offloaded parameter (after the weight manager bound them to their blocks)."""
        with torch._C.DisableTorchFunctionSubclass():
            for index, state in enumerate(self.access.weights.states):
                self._storage_block[state.flat.untyped_storage()._cdata] = index
        for block in self.blocks:
            for slot in block.slots:
                param = slot.param
                base = type(param)
                if base not in self._param_classes:
                    # nn.Parameter's own __deepcopy__ copies without torch_function: route it too.
                    self._param_classes[base] = type(f"Offloaded{base.__name__}", (base,),
                                                     {"__torch_function__": self._routed, "__module__": __name__,
                                                      "__deepcopy__": self._deepcopy})
                self._original_classes[id(param)] = base
                param.__class__ = self._param_classes[base]

    def remove(self) -> None:
        """Give every parameter its own class back."""
        for block in self.blocks:
            for slot in block.slots:
                original = self._original_classes.pop(id(slot.param), None)
                if original is not None:
                    slot.param.__class__ = original
        # The classes refer back to this guard (and through it to the session): let it all go at once. Views
        # the user still holds keep this guard, which now refuses them with a clear error.
        self._closed = True
        self._param_classes.clear()
        self._storage_block.clear()

    # ---- routing ---------------------------------------------------------------------------------------
    def block_of(self, tensor: torch.Tensor) -> int | None:
        """The block whose compute storage tensor views, or None (call with torch functions disabled)."""
        index = self.param_block.get(id(tensor))
        if index is not None:
            return index
        if type(tensor) is self.view_class:
            return self._storage_block.get(tensor.untyped_storage()._cdata)
        return None

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one torch call that involves a guarded tensor (see the module docstring)."""
        if _is_foreach_in_place(func, args):
            with torch._C.DisableTorchFunctionSubclass():
                writes = not self._closed and any(self._is_guarded(t) for t in args[0])
            if writes:
                return self._foreach_write(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            if self._closed:
                raise RuntimeError("this tensor is a view of a parameter of an offload session that was closed; take "
                                   "the view again from the model's parameters")
            if func in METADATA_CALLS:
                return func(*args, **kwargs)
            if func == GRAD_GET:
                return self.clipper.grad_of(args[0])
            if func == DATA_SET:
                self._check_rebind(args[0], args[1])
                return func(*args, **kwargs)
            if func == GRAD_SET:
                self.clipper.on_grad_set(args[0], args[1])
                return func(*args, **kwargs)
            args, kwargs = _target_positional(func, args, kwargs)
            guarded = [(t, self.block_of(t)) for t in _tensors_in((*args, *kwargs.values()))]
            indices = {index for _, index in guarded if index is not None}
            writes = bool(indices) and self._writes_guarded(func, args, kwargs)
            # A write while a pass runs is refused below; one after a pass that raised (its blocks still held
            # until the next forward) is a write between steps, to the master.
            stale_write = writes and not self.passes.pass_running
            if stale_write:
                self.passes.drop_raised_forward_holds()  # their fetched copies would keep the old values
            if not stale_write and all(self.access.in_pass(i) for i in indices):
                if writes:
                    raise RuntimeError(
                        f"{getattr(func, '__name__', func)} writes into an offloaded parameter while its block runs "
                        "forward or backward (a hook registered after offload(), nn.Embedding(max_norm=...)): it would "
                        "change only the compute copy fetched for this pass, not the fp32 master, and be lost. Write "
                        "parameters between steps (param.copy_(...) under torch.no_grad(), load_state_dict), or register "
                        "the hook before offload()")
                result = func(*args, **kwargs)
                # A view made inside a pass (a hook keeping w.t()) must stay safe after the block is released.
                if isinstance(result, torch.Tensor) and result._is_view():
                    return self._guard_views(result)
                return result
            return self._outside_pass(func, args, kwargs, guarded, indices, writes)

    def _outside_pass(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                      guarded: list[tuple[torch.Tensor, int | None]], indices: set[int], writes: bool) -> Any:
        """``dispatch`` of a call on blocks no pass holds now (between steps): a write goes to the master, a no-op
        move or an alias is made from metadata, anything else reads the blocks' current weights first. Called with
        torch functions disabled."""
        if writes:
            return self._write(func, args, kwargs, guarded)
        if (func == TO and no_op_to(args, kwargs)) or (func == CUDA and no_op_cuda(args, kwargs)):
            return args[0]
        if func in ALIAS_CALLS:  # same sizes as the parameter: valid over the released storage
            return self._guard_views(func(*args, **kwargs))
        for index in sorted(indices):
            self.access.prepare_read(index)
        if func in COPY_CALLS:
            return func(args[0].clone(), *args[1:], **kwargs)
        if func == DEEPCOPY:  # copy.deepcopy(model): a plain parameter holding the current weights
            source = args[0]
            base = self._original_classes.get(id(source))
            value = func(source.detach(), args[1]) if base is None else \
                base(source.detach().clone(), requires_grad=source.requires_grad)
            args[1][id(source)] = value
            return value
        return self._guard_views(func(*args, **kwargs))

    def _writes_guarded(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """The call writes into a guarded tensor: in place on its first argument, or through ``out=``."""
        return (_is_in_place(func, kwargs) and self._is_guarded(args[0] if args else None)) \
            or self._is_guarded(kwargs.get("out"))

    def _is_guarded(self, tensor: Any) -> bool:
        return isinstance(tensor, torch.Tensor) and self.block_of(tensor) is not None

    def _check_rebind(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """``param.data = value``: only a no-op rebind (what ``model.to(device)`` does) keeps the parameter a view
        of its block; anything else would silently cut it off from the tiers."""
        same = value is param or (
            value.untyped_storage()._cdata == param.untyped_storage()._cdata and value.dtype == param.dtype
            and value.shape == param.shape and value.stride() == param.stride()
            and value.storage_offset() == param.storage_offset())
        if not same:
            raise RuntimeError(
                "replacing an offloaded parameter's data (param.data = ..., model.to(dtype), model.half()) would cut "
                "it off from tierstore's tiers: convert or move the model before offload (the compute dtype is the "
                "config's `dtype`), or write values with param.copy_(...) / load_state_dict")

    def _guard_views(self, result: Any) -> Any:
        """Results that alias an offloaded block's storage are returned guarded."""
        if isinstance(result, torch.Tensor):
            if type(result) is not self.view_class and result.untyped_storage()._cdata in self._storage_block:
                return result.as_subclass(self.view_class)
            return result
        if isinstance(result, (tuple, list)):
            return type(result)(self._guard_views(r) for r in result)
        return result

    @staticmethod
    def _foreach_write(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """``torch._foreach_mul_(params, 0.5)`` and the like on a list holding offloaded parameters: done as the
        tensor method of the same name, one tensor at a time (each list argument of the same length gives its
        element), so each write to an offloaded parameter reaches its fp32 master (``_write``) like ``p.mul_(0.5)``
        does. As one call it would have changed only the compute copies fetched for it, and been lost."""
        foreach = _op_name(func)
        name = foreach.removeprefix("_foreach_")
        method = getattr(torch.Tensor, name, None)
        function = getattr(torch, name.removesuffix("_"), None)  # torch.maximum for _foreach_maximum_
        if method is None and function is None:
            raise RuntimeError(f"{foreach} writes into offloaded parameters, and tierstore has no tensor method "
                               f"{name} to apply it one parameter at a time: write each parameter in a loop "
                               "(param.copy_(...) under torch.no_grad()) or with model.load_state_dict(...)")
        tensors = args[0]

        def element(arg: Any, position: int) -> Any:
            if isinstance(arg, (list, tuple)) and len(arg) == len(tensors):
                return arg[position]
            if isinstance(arg, torch.Tensor) and arg.dim() == 1 and name in _VALUE_KEYWORD:
                return arg[position].item()  # a tensor of scalars: one scalar for each tensor
            return arg

        for position, tensor in enumerate(tensors):
            rest = [element(a, position) for a in args[1:]]
            extra = dict(kwargs)
            if name in _VALUE_KEYWORD and len(rest) == 3:
                extra["value"] = rest.pop()
            if method is not None:
                method(tensor, *rest, **extra)
            else:
                tensor.copy_(cast(Callable[..., torch.Tensor], function)(tensor, *rest, **extra))
        return list(tensors)

    def _write(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               guarded: list[tuple[torch.Tensor, int | None]]) -> Any:
        """An in-place write outside forward/backward: applied to the fp32 master at the same place."""
        target = args[0] if args else None
        index = self.block_of(target) if isinstance(target, torch.Tensor) else None
        if index is None or "out" in kwargs or not isinstance(target, torch.Tensor):
            raise RuntimeError(
                f"{getattr(func, '__name__', func)} writes into an offloaded parameter through an output argument "
                "or a list; write parameters with model.load_state_dict(...) or param.copy_(value)")
        # As plain torch: a leaf's in-place write with grad on is refused, except torch.nn.init's functions, which
        # write under a no_grad of their own that this call reaches before they enter it.
        if torch.is_grad_enabled() and target.requires_grad and getattr(func, "__module__", None) != "torch.nn.init":
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
        for other, other_index in guarded:
            if other is not target and other_index is not None:
                self.access.prepare_read(other_index)
        self.access.settle(writing=True)
        if not self.access.in_batch:  # (a load's writes passed its barrier once, at its start)
            self.access.before_writes(f"{getattr(func, '__name__', func)} on a parameter")
        block = self.blocks[index]
        size, stride, offset = target.size(), target.stride(), target.storage_offset()

        def apply(master: torch.Tensor) -> None:
            # as_strided counts from the start of the storage: the master is a view into the store's arena.
            place = master.as_strided(size, stride, master.storage_offset() + offset)
            rest = [a.to(master.device) if isinstance(a, torch.Tensor) else a for a in args[1:]]
            func(place, *rest, **kwargs)

        self.access.write_state(block, "master", apply)
        return target
