"""Activations recomputed in the backward (``placement.activations``): each layer block's forward runs again in
the backward instead of keeping its activations, as ``torch.utils.checkpoint`` does.

Why a placement choice: under a GPU cap the activations of a whole forward compete with optimizer state for the
same memory. On an H100 under DeepSpeed ZeRO-2's reservation (31.06 GiB, the 1.35B benchmark model, clipping)
the first step's activations took 25 GiB, so auto placement kept 2 of 27 blocks resident and streamed half the
rest (0.400 s a step); with every layer recomputed the first step peaked at 7.25 GiB and every block was
updated on the GPU (0.324 s: the recomputed forward costs less than the CPU's share of AdamW it removes; call K1
in the README). The gradients are the same: the recomputed forward is the same computation on the same weights
(random state is restored, as ``torch.utils.checkpoint`` does).

How: a layer block's module (``Block.modules[0]`` of an ``is_layer`` block) gets a subclass of its own class
whose ``__call__`` runs the original ``__call__`` (hooks included) under non-reentrant
``torch.utils.checkpoint``, so the recomputation fires the runtime's hooks as a model's own checkpointing does
(``runtime.hooks`` sees it inside the autograd engine and holds the block's weights for its backward).
:meth:`Recompute.undo` gives every module its class back (``OffloadSession.close`` calls it). While it is on, the
modules' class names print as before, but a model pickled whole (``torch.save(model)``) cannot be loaded
without tierstore; state dicts are unchanged.

A layer class with its own ``__call__`` (Hugging Face's ``GradientCheckpointingLayer`` in transformers 4.5x, which
checkpoints there when the model's own checkpointing is on and otherwise calls ``nn.Module.__call__``) has that
call recomputed. What it refuses (:func:`recompute_refusal`): a layer with batch-norm running statistics (a
recomputed forward would update them twice).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.blocks import Block

log = logging.getLogger(__name__)

_RECOMPUTED: dict[type, type] = {}  # a layer class -> its recomputing subclass (one per class, reused)
_ORIGINAL = "_tierstore_recomputes"  # the attribute of a recomputing subclass naming the class it extends


def _recomputing_class(cls: type) -> type:
    """The subclass of ``cls`` whose call runs ``cls``'s call under activation checkpointing during training."""
    if cls not in _RECOMPUTED:
        original_call = cls.__call__

        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            # Only a forward that records a graph keeps activations worth dropping; evaluation runs as before.
            if not torch.is_grad_enabled():
                return original_call(self, *args, **kwargs)
            return checkpoint(original_call, self, *args, use_reentrant=False, **kwargs)

        def _get_name(self: nn.Module) -> str:  # what print(model) shows: the user's class name
            return cls.__name__

        _RECOMPUTED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "_get_name": _get_name,
                                                       "__module__": cls.__module__, _ORIGINAL: cls})
    return _RECOMPUTED[cls]


def layer_modules(blocks: Sequence[Block]) -> list[nn.Module]:
    """The modules whose forward is recomputed: the module of each layer block, in forward order."""
    return [block.modules[0] for block in blocks if block.is_layer and block.modules]


def recompute_refusal(blocks: Sequence[Block]) -> str | None:
    """Why the layers' forwards cannot be recomputed (None: they can)."""
    modules = layer_modules(blocks)
    if not modules:
        return "the model has no repeated layers to recompute (runtime.blocks found no layer container)"
    for module in modules:
        cls = getattr(type(module), _ORIGINAL, type(module))
        for inner in module.modules():
            if isinstance(inner, nn.modules.batchnorm._BatchNorm) and inner.track_running_stats:
                return (f"{cls.__name__} holds batch-norm running statistics ({type(inner).__name__}), which a "
                        "recomputed forward would update twice")
    return None


def already_checkpointed(model: nn.Module) -> bool:
    """The model checkpoints its own layers (Hugging Face ``gradient_checkpointing_enable()``), so recomputing
    them again would run each forward a third time."""
    # transformers 5 renamed the property (the old name warns); older versions have only the old one
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or name in vars(model):
            return bool(getattr(model, name))
    return False


class Recompute:
    """Turns recomputation of the layers' forwards on and off; ``on`` says which it is."""

    def __init__(self, blocks: Sequence[Block]):
        self.modules = layer_modules(blocks)
        self.on = False

    def turn_on(self) -> None:
        """Every layer's forward is recomputed in its backward from the next forward on."""
        if self.on:
            return
        for module in self.modules:
            module.__class__ = _recomputing_class(type(module))
        self.on = True
        log.info("activations: the forwards of %d layers are recomputed in the backward", len(self.modules))

    def undo(self) -> None:
        """Every layer gets its own class back (idempotent)."""
        if not self.on:
            return
        for module in self.modules:
            module.__class__ = getattr(type(module), _ORIGINAL, type(module))
        self.on = False


class ForwardTimer:
    """The GPU seconds the layers' training forwards of a step take: what recomputing them adds to its backward.

    CUDA events on the current stream at each layer's forward pre-hook and forward hook, for every forward that
    records a graph (a recomputation inside the backward is not counted), summed layer by layer. Per layer, not
    from the first layer to the last: between layers the forward may wait for an update (in a step whose updates
    run on the CPU, the second measured step, the wait is most of the span; call K2 in the README chose to keep
    the activations on such a span), and the recomputation in the backward waits for none. The pre-hook runs after
    the runtime's own, which waits for the layer's weights, so a layer's span holds its compute only."""

    def __init__(self, modules: Sequence[nn.Module]):
        from runtime.hooks import in_backward

        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._open: dict[int, torch.cuda.Event] = {}  # id(module) -> its forward's start, until the forward ends

        def begin(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled() and not in_backward():
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                self._open[id(module)] = start

        def end(module: nn.Module, args: Any, output: Any) -> None:
            start = self._open.pop(id(module), None)
            if start is not None and torch.is_grad_enabled() and not in_backward():
                stop = torch.cuda.Event(enable_timing=True)
                stop.record()
                self._spans.append((start, stop))

        self._handles = [handle for module in modules
                         for handle in (module.register_forward_pre_hook(begin), module.register_forward_hook(end))]

    def restart(self) -> None:
        """Forget the forwards timed so far (a new step begins)."""
        self._spans, self._open = [], {}

    def seconds(self) -> float:
        """The timed layers' GPU seconds (waits for the last one to end)."""
        if not self._spans:
            return 0.0
        self._spans[-1][1].synchronize()
        return sum(start.elapsed_time(stop) for start, stop in self._spans) / 1000

    def remove(self) -> None:
        """Take the hooks off."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
