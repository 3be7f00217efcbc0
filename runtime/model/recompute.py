"""Activations recomputed in the backward (``placement.activations``): each layer block's forward runs again in
the backward instead of keeping its activations, as ``torch.utils.checkpoint`` does.

Why a placement choice: under a GPU cap the activations of a whole forward compete with optimizer state for the
same memory. On an H100 under DeepSpeed ZeRO-2's reservation (31.06 GiB, the 1.35B benchmark model, clipping)
the first step peaked at 28.0 GiB (25.1 beyond the plan), so auto placement kept 2 of 27 blocks resident and
streamed half the rest (0.400 s a step, call K1 in docs/measurements-history.md); with every layer recomputed the second measured
step peaked at 7.29 GiB and every block was updated on the GPU (0.321 s: the recomputed forward costs less than
the CPU's share of AdamW it removes; call K3). The gradients are the same: the recomputed forward is the same
computation on the same weights; the random state is restored as ``torch.utils.checkpoint`` does, on every
device a tensor argument lives on (keyword arguments too: their devices are passed to it as empty tensors,
which it reads from the positional ones only).

How: a layer block's module (``Block.modules[0]`` of an ``is_layer`` block) gets a subclass of its own class
whose ``__call__`` runs the original ``__call__`` (hooks included) under non-reentrant
``torch.utils.checkpoint``, so the recomputation fires the runtime's hooks as a model's own checkpointing does
(``runtime.model.hooks`` sees it inside the autograd engine and holds the block's weights for its backward).
:meth:`Recompute.undo` gives every module its class back (``OffloadSession.close`` calls it). While it is on, the
modules' class names print as before, state dicts are unchanged, and a copy (``copy.deepcopy``) or a pickle of a
layer gets the layer's own class (not a class with its own ``__deepcopy__``; a class whose pickling passes
arguments to ``__new__`` is rebuilt without them). Hugging Face layers are called with a key/value cache in
training when the config's ``use_cache`` is on (Llama's and GPT-2's default): a recomputed forward would append
to it a second time. So while recomputation is on, a model whose forward takes ``use_cache`` is given
``use_cache=False`` in training forwards (a forward pre-hook; Hugging Face does the same under its own
checkpointing), and a cache that still reaches a layer, by a keyword Hugging Face uses or positionally, is
dropped with a warning (not where the layer class sets ``_can_checkpoint_with_cache``). A layer's forward hooks,
like its forward, run again in the recomputation.

Only training forwards that record a graph are recomputed (an eval-mode forward runs as is), and a layer flagged
to checkpoint itself (``gradient_checkpointing``, set by Hugging Face) runs its own. A layer class with its own
``__call__`` (Hugging Face's ``GradientCheckpointingLayer`` in some transformers versions, which checkpoints there
when the model's own checkpointing is on and otherwise calls ``nn.Module.__call__``; likely 5.17 on the lent
machine, call K3) has that call recomputed. What it refuses (:func:`recompute_refusal`): a layer with
normalisation running statistics (batch or instance norm: a recomputed forward would update them twice), and a
model flagged to checkpoint its layers itself.
``BufferWatch`` tells ``auto``'s trial whether the layers' forwards change other buffers.
"""

from __future__ import annotations

import copyreg
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from runtime.core.blocks import Block

log = logging.getLogger(__name__)

_RECOMPUTED: dict[type, type] = {}  # a layer class -> its recomputing subclass (one per class, reused)
_ORIGINAL = "_tierstore_recomputes"  # the attribute of a recomputing subclass naming the class it extends


_CACHE_KWARGS = ("cache", "past_key_value", "past_key_values", "layer_past")  # Hugging Face's names of a layer's cache
_warned_of_a_cache = False


def _is_cache(value: Any) -> bool:
    """A Hugging Face key/value cache object (``transformers.Cache`` or a subclass), known without importing it."""
    return value is not None and any(klass.__name__ == "Cache" and klass.__module__.startswith("transformers")
                                     for klass in type(value).__mro__)


def _without_cache(module: nn.Module, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A layer's arguments without a key/value cache: the cache keywords Hugging Face names, and any argument that
    is a cache object (GPT-2 passes it positionally), become None, with a warning the first time (a cache with a
    prefix in it would change what the layer computes: Hugging Face's own checkpointing drops it the same way)."""
    global _warned_of_a_cache
    if getattr(module, "_can_checkpoint_with_cache", False):
        return args, kwargs
    named = [name for name, value in kwargs.items() if value is not None and (name in _CACHE_KWARGS or _is_cache(value))]
    if not named and not any(_is_cache(arg) for arg in args):
        return args, kwargs
    if not _warned_of_a_cache:
        _warned_of_a_cache = True
        log.warning("placement.activations: recompute: %s was called with a key/value cache while recording a graph; "
                    "the recomputed layers run without it (a recomputed forward would append to it twice). Pass "
                    "use_cache=False in training to silence this", type(module).__name__)
    return tuple(None if _is_cache(arg) else arg for arg in args), {**kwargs, **{name: None for name in named}}


def _device_anchors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """An empty tensor on each accelerator a keyword argument's tensor lives on and no positional one does:
    ``torch.utils.checkpoint`` saves and restores the random state of the devices of its positional tensors."""
    positional = {leaf.device for leaf in tree_flatten(args)[0] if isinstance(leaf, torch.Tensor)}
    keyword = {leaf.device for leaf in tree_flatten(kwargs)[0] if isinstance(leaf, torch.Tensor)}
    return tuple(torch.empty(0, device=device) for device in keyword - positional if device.type != "cpu")


def _recomputing_class(cls: type) -> type:
    """The subclass of ``cls`` whose call runs ``cls``'s call under activation checkpointing during training."""
    if cls not in _RECOMPUTED:
        original_call = cls.__call__

        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            # Only a training forward that records a graph keeps activations worth dropping: evaluation (also with
            # gradients on, which may use a cache) runs as before, and so does a layer that checkpoints itself
            # (Hugging Face's, turned on after offload(), e.g. by the Trainer's gradient_checkpointing).
            if not (torch.is_grad_enabled() and self.training) or getattr(self, "gradient_checkpointing", False) is True:
                return original_call(self, *args, **kwargs)
            args, kwargs = _without_cache(self, args, kwargs)
            anchors = _device_anchors(args, kwargs)

            # The keywords are bound here, not handed to checkpoint, whose own keywords (use_reentrant, debug,
            # context_fn...) a layer's could collide with; autograd records through them all the same.
            def run(*anchored: Any) -> Any:
                return original_call(self, *anchored[len(anchors):], **kwargs)

            return checkpoint(run, *anchors, *args, use_reentrant=False)

        def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
            # A copy or a pickle of the layer gets its own class (copy.deepcopy of the model is an ordinary model),
            # rebuilt by the standard library's object reconstructor where the reduction would name this class
            # (pickle refuses another class through copyreg.__newobj__), so a pickle does not need tierstore.
            recomputing = _RECOMPUTED[cls]
            func, args, *rest = cast(Any, cls).__reduce_ex__(self, protocol)
            if func is recomputing:
                func = cls
            if args and args[0] is recomputing:
                if func is copyreg.__newobj__:  # type: ignore[attr-defined]
                    func, args = copyreg._reconstructor, (cls, object, None)  # type: ignore[attr-defined]
                else:
                    args = (cls, *args[1:])
            return (func, args, *rest)

        _RECOMPUTED[cls] = type(cls.__name__, (cls,), {
            "__call__": __call__, "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "__doc__": cls.__doc__, _ORIGINAL: cls})
    return _RECOMPUTED[cls]


def layer_modules(blocks: Sequence[Block]) -> list[nn.Module]:
    """The modules whose forward is recomputed: the module of each layer block, in forward order."""
    return [block.modules[0] for block in blocks if block.is_layer and block.modules]


def recompute_refusal(blocks: Sequence[Block], model: nn.Module | None = None) -> str | None:
    """Why the layers' forwards cannot be recomputed (None: they can): no layers, normalisation running statistics,
    or the model checkpointing them itself (``already_checkpointed``, the model's own flag counted where given)."""
    modules = layer_modules(blocks)
    if not modules:
        return "the model has no repeated layers to recompute (runtime.core.blocks found no layer container)"
    for module in modules:
        cls = getattr(type(module), _ORIGINAL, type(module))
        for inner in module.modules():
            if isinstance(inner, nn.modules.batchnorm._NormBase) and inner.track_running_stats:
                return (f"{cls.__name__} holds normalisation running statistics ({type(inner).__name__}), which a "
                        "recomputed forward would update twice")
    if already_checkpointed(blocks, model):
        return "the model already checkpoints its layers (gradient_checkpointing_enable())"
    return None


def already_checkpointed(blocks: Sequence[Block], model: nn.Module | None = None) -> bool:
    """The model checkpoints its layers (Hugging Face's ``gradient_checkpointing_enable()`` sets
    ``gradient_checkpointing`` on each layer, or in versions before ``GradientCheckpointingLayer`` on the module
    that calls them), so recomputing them again would run their forward once more."""
    modules = [inner for module in layer_modules(blocks) for inner in module.modules()]
    if model is not None:
        modules += list(model.modules())
    return any(getattr(module, "gradient_checkpointing", False) is True for module in modules)


def _cache_switch(model: nn.Module | None) -> Callable[[], None] | None:
    """Where ``model``'s forward takes ``use_cache`` (a Hugging Face model), a forward pre-hook that passes
    ``use_cache=False`` to a training forward, as Hugging Face does under its own checkpointing (versions before
    ``GradientCheckpointingLayer`` expect a layer given a cache to return it); returns the hook's remover."""
    if model is None:
        return None
    try:
        parameters = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    if "use_cache" not in parameters:
        return None
    position = parameters.index("use_cache")

    def no_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if module is model and module.training and torch.is_grad_enabled() and len(args) <= position:
            return args, {**kwargs, "use_cache": False}
        return None

    return model.register_forward_pre_hook(no_cache, with_kwargs=True).remove


class Recompute:
    """Turns recomputation of the layers' forwards on and off; ``on`` says which it is. ``model``: the model whose
    training forwards get ``use_cache=False`` while it is on (where its forward takes it)."""

    def __init__(self, blocks: Sequence[Block], model: nn.Module | None = None):
        self.modules = layer_modules(blocks)
        self.model = model
        self.on = False
        self._cache_off: Callable[[], None] | None = None

    def turn_on(self) -> None:
        """Every layer's forward is recomputed in its backward from the next forward on."""
        if self.on:
            return
        self.on = True  # first: undo() then restores whatever a failure half-way left swapped
        for module in self.modules:  # from the layer's own class, should a copy carry a recomputing one
            module.__class__ = _recomputing_class(getattr(type(module), _ORIGINAL, type(module)))
        self._cache_off = _cache_switch(self.model)
        log.info("activations: the forwards of %d layers are recomputed in the backward", len(self.modules))

    def undo(self) -> None:
        """Every layer gets its own class back (idempotent)."""
        for module in self.modules:
            module.__class__ = getattr(type(module), _ORIGINAL, type(module))
        if self._cache_off is not None:
            self._cache_off()
            self._cache_off = None
        self.on = False


class BufferWatch:
    """Whether the layers' forwards change their buffers (in place, or by replacing them): such a forward run again
    in the backward would change them twice (spectral norm's power iteration, quantisation observers, a counter or
    an average kept in a buffer). ``mark()`` before a step, ``changed()`` after it."""

    def __init__(self, modules: Sequence[nn.Module]):
        self.modules = list(modules)
        # name -> (the buffer, its version): the tensor itself is held, so a replacement can never reuse its id
        self._seen: dict[str, tuple[torch.Tensor, int]] = {}

    def _now(self) -> dict[str, tuple[torch.Tensor, int]]:
        return {f"{type(module).__name__}[{index}].{name}": (buffer, buffer._version)
                for index, module in enumerate(self.modules) for name, buffer in module.named_buffers()}

    def mark(self) -> None:
        """Remember every buffer of the layers as it is now."""
        self._seen = self._now()

    def changed(self) -> str | None:
        """The first buffer changed in place or replaced since ``mark()`` (None: none)."""
        now = self._now()
        for name, (buffer, version) in self._seen.items():
            current = now.get(name)
            if current is None or current[0] is not buffer or current[1] != version:
                return name
        return None


def least_per_layer(steps: Sequence[dict[Any, float]]) -> float:
    """The sum over layers of each one's least seconds among ``steps`` (each: seconds by layer; a layer missing
    from a step is not counted there): {a: 0.03, b: 0.05}, {a: 0.04, b: 0.02} -> 0.05."""
    least: dict[Any, float] = {}
    for step in steps:
        for layer, seconds in step.items():
            least[layer] = min(seconds, least.get(layer, seconds))
    return sum(least.values())


class ForwardTimer:
    """The GPU seconds the layers' training forwards of a step take: what recomputing them adds to its backward.

    CUDA events on the device's current stream at each layer's forward pre-hook and forward hook, for every training
    forward that records a graph (a recomputation inside the backward is not counted), summed per layer over a
    step. Per layer, not from the first layer to the last: between layers the forward may wait for an update (in a
    step whose updates run on the CPU, the second measured step, the wait is most of the span; call K2 in
    docs/measurements-history.md chose to keep the activations on such a span), and the recomputation in the backward waits for none.
    The pre-hook runs after the runtime's own, which waits for the layer's weights, so a layer's span holds its
    compute, and the gaps between its kernels. Those gaps grow while the CPU's AdamW threads run beside the forward
    (they slow the launching thread): the second measured step's forward runs beside the first step's updates, and
    timed there alone the benchmark model's layers read 0.104 s against 0.076-0.082 in other steps (call L4), which
    priced recomputation above keeping. So each layer counts its least time over the steps timed (``next_step``
    starts one): the first step's forward runs beside no update, and its first layer's warm-up is not counted
    either (a least of the step totals would keep one of the two). With step-to-step noise alone the figure reads
    slightly low. Only the modules given are timed (a ``copy.deepcopy`` of the model shares the hooks'
    closures)."""

    def __init__(self, modules: Sequence[nn.Module], device: torch.device):
        from runtime.model.hooks import in_backward

        self._spans: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []  # this step's: (id(module), start, end)
        self._steps: list[dict[int, float]] = []  # earlier steps': seconds by id(module)
        self._open: dict[int, torch.cuda.Event] = {}  # id(module) -> its forward's start, until the forward ends
        timed = {id(module) for module in modules}

        def mark() -> torch.cuda.Event:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event

        def begin(module: nn.Module, args: Any) -> None:
            if id(module) in timed and module.training and torch.is_grad_enabled() and not in_backward():
                self._open[id(module)] = mark()

        def end(module: nn.Module, args: Any, output: Any) -> None:
            start = self._open.pop(id(module), None)
            if start is not None and torch.is_grad_enabled() and not in_backward():
                self._spans.append((id(module), start, mark()))

        self._handles = [handle for module in modules
                         for handle in (module.register_forward_pre_hook(begin), module.register_forward_hook(end))]

    def next_step(self) -> None:
        """A new step begins: the forwards timed so far are one step's (none: nothing is kept)."""
        step = self._step_seconds()
        if step:
            self._steps.append(step)
        self._spans, self._open = [], {}

    def drop_step(self) -> None:
        """Forget the forwards of the step under way (it was dropped: a retried forward may differ)."""
        self._spans, self._open = [], {}

    def seconds(self) -> float:
        """The timed layers' GPU seconds a step: each layer's least over the steps timed, the current one included
        (waits for its last forward to end)."""
        return least_per_layer([*self._steps, self._step_seconds()])

    def _step_seconds(self) -> dict[int, float]:
        if not self._spans:
            return {}
        self._spans[-1][2].synchronize()
        seconds: dict[int, float] = {}
        for module, start, stop in self._spans:
            seconds[module] = seconds.get(module, 0.0) + start.elapsed_time(stop) / 1000
        return seconds

    def remove(self) -> None:
        """Take the hooks off."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
